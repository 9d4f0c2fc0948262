"""Planner service: decides the replica count of each worker pool against an SLO and scales it."""
from .config import PlannerConfig
from .service import PlannerService

__all__ = ["PlannerConfig", "PlannerService"]
