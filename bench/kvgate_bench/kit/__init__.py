"""The test kit: what the tests and the benchmarks share, and no benchmark.

``controlplane`` (a local kube-apiserver and etcd), the servers (``redisserver``, ``promserver``,
``faultproxy``, ``llamaserver``), ``processes`` (the one module that starts and stops every child
process), ``nodestack`` (a node agent and sidecars against the control plane) and ``toolkit``
(clocks, waiting, ports, Prometheus samples, percentiles). The kit never imports a benchmark (an
import-linter contract in ``pyproject.toml``).
"""
