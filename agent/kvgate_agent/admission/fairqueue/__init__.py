"""The fair queue of one pod: who waits, in which order, and what a tenant may take.

Five roles, one module each:

- :mod:`.share`: the fair share between tenants, the virtual token counters of VTC
  (:class:`FairShare`, held by :class:`~kvgate_agent.admission.limits.Limits` as ``fair``).
- :mod:`.order`: the fair order of the waiters: priority bands, then tenants by their
  counters, then each tenant's own order (``FairOrder``).
- :mod:`.reserve`: the fair reserve kept from a tenant above its share, and
  :func:`what_blocks`, the one check every admission passes through.
- :mod:`.pool`: the pool's view of the same tenants' service on other replicas
  (:class:`PoolShare`, the exchange of service counters; attached to a pod's fair share).
- :mod:`.waitqueue`: the wait queue (:class:`WaitQueue`): the waiters' deadlines, the pass
  that admits those that fit in the fair order, the decisions collected.

Driving the queue (queueing what the overload actions queue, expiring, pumping, the next
wake) is the controller's :mod:`kvgate_agent.admission.waiting`, above this package.

The rest of admission imports what it uses from here (``__all__``); modules of this package
import each other directly. One exception: :mod:`kvgate_agent.admission.limits` imports
:mod:`.share` itself (the limits hold the counters, and the reserve and the queue read the
limits: the face would import back into them).
"""

from __future__ import annotations

from kvgate_agent.admission.fairqueue.pool import STALE_S, PoolShare
from kvgate_agent.admission.fairqueue.reserve import PREFILL_SHARE, what_blocks
from kvgate_agent.admission.fairqueue.share import FairShare
from kvgate_agent.admission.fairqueue.waitqueue import MAX_SKIPS, WaitQueue

__all__ = [
    "MAX_SKIPS",
    "PREFILL_SHARE",
    "STALE_S",
    "FairShare",
    "PoolShare",
    "WaitQueue",
    "what_blocks",
]
