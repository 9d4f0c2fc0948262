"""From generations to the wire: per-choice events (events.py), the one SSE loop of every streaming
endpoint (pump.py) with its framing (sse.py), the writer of OpenAI's chunk streams (chunks.py) and
the OpenAI response pieces (formats.py: usage, logprobs)."""
