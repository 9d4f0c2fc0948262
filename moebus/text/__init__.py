"""Text in and out of a model, torch-free: the tokenizer (GGUF or HF vocabularies, the chat
template), prompt rendering, incremental detokenization, stop strings and the tool-call parsers.

The frontend (HTTP process), the tokenizer service, the load tester and the engine all use it;
it imports neither torch nor the engine (pyproject.toml [tool.importlinter])."""
