"""kvgate's two demos, one package.

- :mod:`kvgate_bench.demo.http` (``python -m kvgate_bench.demo``): a bursty three-tenant load
  over real HTTP, sent to kvgate-sim without and with the kvgate sidecar, in real time (its
  schedule in :mod:`~kvgate_bench.demo.http_schedule`, its report in
  :mod:`~kvgate_bench.demo.http_report`, its load generator in :mod:`~kvgate_bench.demo.loadgen`).
- :mod:`kvgate_bench.demo.virtual` (``python -m kvgate_bench.demo.virtual``, what
  ``scripts/demo`` runs): one seeded schedule through no admission, a tuned concurrency cap and
  kvgate, in virtual time on a realistic engine model (its report in
  :mod:`~kvgate_bench.demo.virtual_report`).

What both share (the --duration/--seed/--quiet flags, table rows, a figure or "-") is
:mod:`kvgate_bench.demo.common`'s. The test kit never imports this package.
"""
