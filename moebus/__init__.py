"""moebus: a serving stack for mixture-of-experts LLMs."""
