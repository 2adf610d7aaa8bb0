"""The canary runtime: ``CanaryManager`` (outer step) and ``SingleForwardManager`` (one forward)."""

from .brackets import CanaryBracketError
from .manager import BatchAdapter, CanaryManager
from .single_forward import SingleForwardManager

__all__ = ["BatchAdapter", "CanaryBracketError", "CanaryManager", "SingleForwardManager"]
