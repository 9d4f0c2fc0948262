from __future__ import annotations

from pydantic import Field

from moebus.shared.service import ServiceConfig


class EncoderConfig(ServiceConfig):
    model: str = "smollm2"  # the language model whose input embeddings the rows are
    served_model_name: str | None = None  # the name clients use; default: `model`
    encoder: str = "efficientnet-lite0"  # or a SmolVLM/Idefics3 checkpoint folder, or an mmproj .gguf
    top_k: int = Field(3, ge=1, le=16)  # efficientnet-lite0: classes (= image tokens) per image
    max_batch: int = Field(16, ge=1)  # images per encoder forward
    batch_wait_ms: float = Field(2.0, ge=0)  # how long a lone image waits for company
    cache_bytes: int = Field(256 << 20, ge=0)  # encoder cache (LRU by bytes of stored rows); 0: off
    wire_dtype: str = "float16"  # rows on the bus: float16, bfloat16 or float32
    max_image_bytes: int = Field(8 << 20, ge=1)  # an image file larger than this is refused
    max_pixels: int = Field(40_000_000, ge=1)  # width x height, checked before decoding
    max_images: int = Field(8, ge=1)  # per request
    allow_http: bool = False  # fetch http(s) image URLs (off: only data URLs and allowed files)
    fetch_timeout_s: float = Field(10.0, gt=0)
    allowed_local_dir: str | None = None  # file:// URLs and paths under this directory; None: refused
    torch_threads: int | None = None  # torch intra-op threads of this process (None: torch's default)
