"""Balancer service: least-loaded routing from heartbeats, dead-worker detection."""
from .config import BalancerConfig
from .service import BalancerService

__all__ = ["BalancerConfig", "BalancerService"]
