"""kvgate's control plane (kopf operator). A skeleton until the control-plane issue lands."""
