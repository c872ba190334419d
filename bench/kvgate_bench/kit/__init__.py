"""The test kit: what the tests and the benchmarks share, and no benchmark.

``controlplane`` (a local kube-apiserver and etcd: the processes; ``kubeaccess`` talks to them,
``kubefiles`` makes their certificates and kubeconfigs with ``certs``, the kit's own test CA),
``operator_process`` (the operator as a child process against it), the servers
(``redisserver``, ``promserver``, ``faultproxy``, ``llamaserver``), ``processes`` (the one module
that starts and stops every child process), ``nodestack`` (a node agent and sidecars against the
control plane), ``toolkit`` (clocks, waiting, ports, Prometheus samples, percentiles), ``sse`` (a
streamed answer's JSON events) and ``doc_block`` (the generated block of a Markdown file, refused
when others' text sits in it). The kit imports nothing else of ``kvgate_bench`` (no benchmark,
demo or simulator) and nothing of the operator (an import-linter contract in ``pyproject.toml``).
"""
