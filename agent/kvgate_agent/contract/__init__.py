"""The contract between control plane and data plane: the API names (:mod:`.api`), the
RateLimitPolicy (:mod:`.policy`), the NodeAdmission object (:mod:`.nodeadmission`) and the
sidecar-to-node-agent sync protocol (:mod:`.sync`), all on one pydantic base (:mod:`.base`).
The operator may import this package, nothing else of the agent."""
