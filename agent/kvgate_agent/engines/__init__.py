"""Model-server facts read from the engines' own exposition, shared by the sidecar and the node
agent (pure: no HTTP)."""
