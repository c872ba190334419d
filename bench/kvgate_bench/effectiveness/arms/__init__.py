"""The arms of the effectiveness benchmark: what a platform team would put in front of the engine.

``registry`` (every arm by name, what each stands for, the settings swept: the face the runs
use), ``context`` (what an arm may know of the deployment), ``baselines`` (``none``, a
concurrency cap, token buckets, llm-d's saturation shedding), ``flow_control`` (llm-d's flow
control), ``vllm_queue_limit`` (vLLM's queue limits), ``codel_gate`` (Dynamo's CoDel gate),
``dynamo_drr`` (Dynamo's policy-class queues), ``occupancy_budget`` (hivenet_router's
occupancy budget), ``kvgate_arms`` (the real admission core on the virtual clock) and
``kvgate_defaults`` (kvgate on the README's policies). Arms implement
:class:`~kvgate_bench.effectiveness.model.gate.Arm`.
"""
