"""Development stand-ins, not a served model: the torch-free toy engine and tokenizer (model name
"toy") that tests and smoke runs serve through the real services."""
