"""The store of ``shared`` limits: the Redis link holding one token bucket per key
(``buckets``), the exchange of the tenants' service counters between sidecars (``exchange``)
and where the store lives (``settings``).

Other rooms import what they use from here (``__all__``); modules of this room import
each other directly.
"""

from __future__ import annotations

from kvgate_agent.sidecar.store.buckets import StoreLink, register_metrics
from kvgate_agent.sidecar.store.exchange import ShareExchange, share_exchange
from kvgate_agent.sidecar.store.settings import StoreSettings

__all__ = ["ShareExchange", "StoreLink", "StoreSettings", "register_metrics", "share_exchange"]
