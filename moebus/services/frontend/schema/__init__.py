"""Request bodies: parsing under the edge limits (body.py), the base model (fields.py), the OpenAI
bodies and their bounds (protocol.py), structured outputs (guided.py), function tools (tools.py)."""
