"""The contract between control plane and data plane: the RateLimitPolicy model (and, later,
the NodeAdmission threshold schema). The operator may import this package, nothing else of the
agent."""
