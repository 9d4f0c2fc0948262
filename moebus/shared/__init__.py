"""moebus.shared: bus plumbing, subjects, message schemas, tracing and metrics for the services.

Never imports torch: every service (including the torch-free frontend) depends on it.
"""
