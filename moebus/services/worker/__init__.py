"""Worker service: runs an engine, admission control, token streaming, abort, graceful drain."""
from .config import WorkerConfig
from .service import WorkerService

__all__ = ["WorkerConfig", "WorkerService"]
