"""The HTTP endpoints: OpenAI chat completions and completions, Responses, Anthropic Messages, tokenize /
detokenize, /openapi.json; a chat conversation rendered to prompt tokens (rendering.py) and one
assistant turn for the APIs that are not chat completions (turn.py)."""
