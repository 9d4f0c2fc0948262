"""`moebus eval`: the quality gate of an engine configuration against HF transformers fp32 on the
same weights (text.py inputs, synthetic.py seeded token ids for tiny random models, tiny_v4.py the
`--model tiny-v4` checkpoint, reference.py HF, candidate.py the engine, disagg.py prefill -> KV ->
decode engines, ep.py an expert-parallel group, metrics.py the numbers, configs.py the named
configurations, run.py one run, report.py tables/JSON, cli.py the command)."""
