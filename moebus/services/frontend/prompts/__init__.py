"""Prompts before routing: image parts to encoder inputs and their places (images.py), and prompts
rendered in this process (local_render.py)."""
