"""`moebus loadtest`: replay traffic traces (or synthetic arrivals) against any OpenAI-compatible
endpoint and report latency SLOs.

One idea per module: trace (the request list and its shaping: window, time and length scale),
formats (Mooncake / Azure / BurstGPT / aiperf readers), synthetic (Poisson / gamma arrivals),
prompts (exact-token-count prompts with shared prefix blocks), client (one streamed request),
runner (open- and closed-loop replay), summary (percentiles, goodput), plots, compare, cli;
ab (variants alternating in rounds, medians: the in-process A/B scripts in loadtest/).
This package talks HTTP only: it imports no service.
"""
