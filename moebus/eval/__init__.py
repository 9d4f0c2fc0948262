"""`moebus eval`: the quality gate of an engine configuration against HF transformers fp32 on the
same weights (text.py inputs, reference.py HF, candidate.py the engine, metrics.py the numbers,
configs.py the named configurations, run.py one run, report.py tables/JSON, cli.py the command)."""
