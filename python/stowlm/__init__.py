"""stowlm: run GGUF language models fast, stowed across the memory you have."""

from . import _core

__version__ = "0.1.0"

__all__ = ["__version__"]
