"""Who may send what: API keys to tenants (tenants.py), admission per tenant (admission.py) and its fair
queue (fair_queue.py), the access log and request ids (access.py)."""
