"""stowlm: run GGUF language models fast, stowed across the memory you have."""

from . import _core
from . import gguffile
from .engine import Context, Model
from . import fit  # stowlm.fit.fit(...) decides a placement
from .fit import FitError
from .gguffile import GGUFFile
from .llm import LLM, Completion
from .llama_api import Llama  # llama-cpp-python's class, for scripts written for llama_cpp
from .placement import Placement

from .version import __version__

__all__ = ["__version__", "LLM", "Llama", "Completion", "GGUFFile", "Model", "Context", "FitError", "Placement"]
