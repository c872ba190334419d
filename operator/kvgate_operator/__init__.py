"""kvgate's control plane: a kopf operator that turns RateLimitPolicies into one NodeAdmission per
node and serves the sidecar-injection webhook; ``handlers`` registers it with kopf."""
