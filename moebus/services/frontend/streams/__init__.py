"""From generations to the wire: per-choice events (events.py), the one SSE loop (sse_pump.py) and the
OpenAI response pieces (formats.py: usage, logprobs, SSE framing)."""
