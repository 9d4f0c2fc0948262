"""Bus message schemas, grouped by the service that receives them (round-trip tested)."""
from .control import HealthReply, Heartbeat, KVInfo, Load, WorkerLost
from .encoder import EncodeReply, EncodeRequest, ImageEmbedding, ImageInput, ImagePromptForm
from .generate import (
    AbortRequest,
    GenerateAccepted,
    GenerateRequest,
    Handoff,
    HandoffBeat,
    KVTransferSpec,
    SamplingOptions,
    StructuredOptions,
    TokenChunk,
    TokenChunks,
    TokenLogprob,
    TopLogprob,
)
from .kvbroker import (
    BROKER_HOLDER,
    BlockGet,
    BlockGetReply,
    BrokerStats,
    KVEvent,
    PrefixMatch,
    PrefixQuery,
    PrefixQueryReply,
    TierName,
)
from .planner import PlannerDecision, PoolDecision, PoolObservation
from .tokenizer import (
    ChatMessage,
    ContentPart,
    DetokenizeReply,
    DetokenizeRequest,
    RenderReply,
    RenderRequest,
)

__all__ = [
    "AbortRequest", "ChatMessage", "ContentPart", "DetokenizeReply", "DetokenizeRequest", "GenerateAccepted",
    "GenerateRequest", "Handoff", "HandoffBeat", "HealthReply", "Heartbeat", "KVInfo", "KVTransferSpec", "Load", "RenderReply", "RenderRequest",
    "SamplingOptions", "StructuredOptions", "TokenChunk", "TokenChunks", "TokenLogprob", "TopLogprob",
    "WorkerLost",
    # planner
    "PlannerDecision", "PoolDecision", "PoolObservation",
    # kvbroker
    "BROKER_HOLDER", "BlockGet", "BlockGetReply", "BrokerStats", "KVEvent", "PrefixMatch", "PrefixQuery",
    "PrefixQueryReply", "TierName",
    # encoder
    "EncodeReply", "EncodeRequest", "ImageEmbedding", "ImageInput", "ImagePromptForm",
]
