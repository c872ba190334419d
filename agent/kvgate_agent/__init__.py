"""kvgate's data plane: the admission core, the sidecar (``kvgate-agent sidecar``) and the node
agent (``kvgate-agent node``); ``docs/architecture.md`` shows how the packages depend on each
other."""

__version__ = "0.1.0"
