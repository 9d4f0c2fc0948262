"""KV-cache concepts shared by services and the engine."""
