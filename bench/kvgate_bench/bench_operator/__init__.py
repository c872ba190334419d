"""``python -m kvgate_bench.bench_operator``: the operator at scale against a real API server.

Starts a local control plane (:class:`kvgate_bench.kit.controlplane.ControlPlane`: kube-apiserver +
etcd, no kubelet), applies the CRDs and creates ``--nodes`` Node objects, namespaces,
``--policies`` RateLimitPolicies and ``--pods`` Pods bound to the nodes (``spec.nodeName``).
Policies select ~``pods/policies`` pods each; half carry a ``per: Global`` limit (split across
their pods), half only ``per: Tenant`` limits; in every fourth namespace one policy overlaps an
older one (conflicts, Warning events). Then it starts ``python -m kvgate_operator`` as a child
process and measures:

1. **initial convergence**: from the operator's start until every NodeAdmission spec and every
   policy status equals the from-scratch computation (:func:`kvgate_operator.desired.compute` on
   a fresh read, done by the benchmark before the operator starts; the cluster's inputs do not
   change meanwhile), polled every ``--poll`` seconds;
2. **no-op resyncs**: the writes made during ``--noop-periods`` resync periods of a converged,
   unchanged cluster (target: 0) and how many passes ran;
3. **one policy changed** (a ``per: Global`` rate doubled): time to converge again and the writes
   (target: one NodeAdmission write per node that runs a pod of that policy, one status write,
   no event), and which NodeAdmissions actually changed (resourceVersion);
4. **agent heartbeats**: ``--heartbeat-rate`` status patches per second on the NodeAdmissions
   (what node agents reporting a heartbeat would do) for ``--heartbeat-seconds``: the status is
   no input of the desired state, so the target is no write; the passes and the CPU they cost
   are what this phase shows.

Every pass LISTs the policies once, so the pass count of a phase is the API server's count of
policy LISTs, less the benchmark's own polls (and kopf's initial LIST).

Plus the operator process's CPU time (``/proc/<pid>/stat`` utime + stime) and peak RSS
(``VmHWM``), the API server's and etcd's CPU (their ``process_cpu_seconds_total``) and, with the
operator stopped, one pass run in this process phase by phase (read / compute / plan).

**How writes are counted**: the API server's own counter ``apiserver_request_total`` (from
``/metrics``), diffed around each phase, over the write verbs (POST, PUT, PATCH, APPLY, DELETE,
DELETECOLLECTION). Every request counts, including one that changes nothing or fails (a
resourceVersion diff would miss both). The operator is the only client writing NodeAdmissions,
policy *status* and Events while a phase runs (the benchmark's own change is a PATCH of the
policy's main resource), so those series are the operator's writes; all other writes are shown
separately (the API server's own leases). The operator's log lines ``reconciled: ...`` are
summed as a cross-check.

The modules: ``cli`` (the options and the run, phase by phase), ``phases`` (each phase's
counters and checks), ``cluster`` (the synthetic cluster and its desired state), ``api`` (the
API server's client and counters), ``inprocess`` (one pass run in this process, timed and
profiled) and ``report`` (the printed table and notes).
"""
