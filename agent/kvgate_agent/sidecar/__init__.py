"""The sidecar (``kvgate-agent sidecar``): admission control in front of one model server.

Its rooms, one sub-package each along a request's path, under a thin top (:mod:`.app`
composes them, :mod:`.pipeline` runs a request through them; :mod:`.server`, :mod:`.cli`,
:mod:`.settings`, :mod:`.policy_control`, :mod:`.metrics`, :mod:`.metrics_view`):
``edge`` (the clients' HTTP legs), ``identity`` (who is asking), ``reading`` (the route, the
body's parse, the prompt's tokens, the answers), ``upstream`` (forwarding to the model server),
``engine`` (reading the engine), ``node_link`` (the node agent's thresholds) and ``store`` (shared
limits). Each room's ``__init__`` is its face: other rooms import what it re-exports, and the
import contracts in ``pyproject.toml`` keep a lower room from importing a higher one.
"""
