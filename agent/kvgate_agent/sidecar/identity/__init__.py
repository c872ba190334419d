"""Who is asking, in one call: :meth:`Authenticator.who` (headers and the policy enforced now ->
:class:`Identity`: tenant, class, priority). Inside: the tenant named from a credential
(``identity``: API keys by their SHA-256, verified JWTs, trusted headers), the keys and JWKS
files (``keyfiles``), the class, priority and engine priority (``tenants``) and the tenant
classes (``classes``).

Other rooms import what they use from here (``__all__``); modules of this room import
each other directly.
"""

from __future__ import annotations

from kvgate_agent.sidecar.identity.identity import INVALID_API_KEY, Authenticator
from kvgate_agent.sidecar.identity.keyfiles import KeyFileError
from kvgate_agent.sidecar.identity.tenants import Identifier, Identity, engine_priority

__all__ = [
    "INVALID_API_KEY",
    "Authenticator",
    "Identifier",
    "Identity",
    "KeyFileError",
    "engine_priority",
]
