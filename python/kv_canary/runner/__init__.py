"""The canary runtime: ``CanaryManager`` (outer step) and ``SingleForwardManager`` (one forward)."""

from .manager import BatchAdapter, CanaryBracketError, CanaryManager
from .single_forward import SingleForwardManager

__all__ = ["BatchAdapter", "CanaryBracketError", "CanaryManager", "SingleForwardManager"]
