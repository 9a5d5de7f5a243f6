"""Micro-batching: which waiting requests run together, and when (pure, clock injected)."""

from .engine import Engine
from .simulator import LinearCost, simulate
from .types import Batch, Plan, Policy, Reason, Waiting

__all__ = ["Batch", "Engine", "LinearCost", "Plan", "Policy", "Reason", "Waiting", "simulate"]
