"""The pool of ``python -m kvgate_bench.effectiveness --replicas N``: N replicas, each an engine
behind its arm, behind a router, on one virtual clock.

``driver`` (the pool's virtual-time loop, its replicas and the client's retries), ``routers``
(kube-proxy's random pick, Envoy's least request, llm-d's EPP scorer; Envoy's retry policy),
``runner`` (the router x arm runs) and ``report`` (the pool mode's printed report and JSON).
"""
