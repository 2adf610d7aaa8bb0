"""Deliberate KV corruption (env-var probabilities) that proves the canary detects it."""

from .manager import PerturbManager

__all__ = ["PerturbManager"]
