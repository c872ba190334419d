"""The node role (``kvgate-agent node``): one per GPU node (DaemonSet).

Reads NVML, scrapes the local model servers' metrics, serves thresholds to the sidecars of its
node over HTTP, and writes its ``NodeAdmission`` status.
"""
