"""Per-choice output state (choice.py: text, detokenization, stop strings, logprobs, finish) and the
latencies clients see (latency.py)."""
