"""kvgate's data plane: the admission core, the sidecar proxy and (later) the node agent."""

__version__ = "0.1.0"
