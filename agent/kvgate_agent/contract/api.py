"""kvgate's Kubernetes API names: the group, the one version, and each kind with its plural.

Every manifest, watch and API path in the repository takes its ``apiVersion`` from here, so a
new version is one edit.
"""

from __future__ import annotations

from typing import Final

GROUP: Final = "kvgate.io"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"

RATE_LIMIT_POLICY_KIND: Final = "RateLimitPolicy"
RATE_LIMIT_POLICY_PLURAL: Final = "ratelimitpolicies"
NODE_ADMISSION_KIND: Final = "NodeAdmission"
NODE_ADMISSION_PLURAL: Final = "nodeadmissions"

__all__ = [
    "API_VERSION",
    "GROUP",
    "NODE_ADMISSION_KIND",
    "NODE_ADMISSION_PLURAL",
    "RATE_LIMIT_POLICY_KIND",
    "RATE_LIMIT_POLICY_PLURAL",
    "VERSION",
]
