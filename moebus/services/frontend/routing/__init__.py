"""One request's generation at the frontend: routed, its chunks received in order (router.py, ordering.py),
migrated, aborted (generation.py), and its spans (spans.py, finish.py)."""
