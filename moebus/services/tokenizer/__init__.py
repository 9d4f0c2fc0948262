"""Tokenizer service: chat template rendering + encoding, stateless incremental detokenization."""
from .config import TokenizerConfig
from .service import TokenizerService

__all__ = ["TokenizerConfig", "TokenizerService"]
