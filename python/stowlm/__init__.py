"""stowlm: run GGUF language models fast, stowed across the memory you have."""

from . import _core
from .engine import Context, Model

__version__ = "0.1.0"

__all__ = ["__version__", "Model", "Context"]
