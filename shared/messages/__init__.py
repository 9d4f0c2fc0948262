"""Bus message schemas, grouped by the service that receives them (round-trip tested)."""
from .control import HealthReply, Heartbeat, Load, WorkerLost
from .generate import (
    AbortRequest,
    GenerateAccepted,
    GenerateRequest,
    SamplingOptions,
    StructuredOptions,
    TokenChunk,
    TokenLogprob,
    TopLogprob,
)
from .tokenizer import ChatMessage, DetokenizeReply, DetokenizeRequest, RenderReply, RenderRequest

__all__ = [
    "AbortRequest", "ChatMessage", "DetokenizeReply", "DetokenizeRequest", "GenerateAccepted",
    "GenerateRequest", "HealthReply", "Heartbeat", "Load", "RenderReply", "RenderRequest",
    "SamplingOptions", "StructuredOptions", "TokenChunk", "TokenLogprob", "TopLogprob",
    "WorkerLost",
]
