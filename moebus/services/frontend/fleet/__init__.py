"""The fleet as this frontend hears it from heartbeats: status rows and gauges (fleet.py), readiness
(readiness.py), how many frontends share the tenants' limits (peers.py), which encoder gets an image
(encoders.py)."""
