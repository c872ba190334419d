"""What the effectiveness benchmark shows: ``tables`` (the printed report: each point's rows,
the headline ratios, the sweeps), ``plots`` (PNG figures against load) and ``progress`` (the
progress line on stderr, shared with the virtual-time demo).
"""
