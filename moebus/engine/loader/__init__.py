"""Checkpoint loaders: GGUF files and HF-layout directories."""
