"""Shared test fixtures: real models (pulled once into the stowlm cache) and llama.cpp fixtures."""
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("STOWLM_SHARED", REPO.parent / "shared"))
FIXTURES = SHARED / "fixtures"
DENSE_MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"]
MOE_MODELS = ["smollm2-moe", "qwen3moe-tiny"]


def cache_dir() -> Path:
    return Path(os.environ.get("STOWLM_CACHE", Path.home() / ".cache" / "stowlm")) / "models"


def get_model(name: str) -> Path:
    """Path of a model of shared/models.md, pulled (or, for the MoE test models, generated) once."""
    path = cache_dir() / f"{name}.gguf"
    if path.exists():
        return path
    if name in MOE_MODELS:
        src = get_model("smollm2-135m")
        tool = SHARED / "tools" / "make_moe_models.py"
        subprocess.run([sys.executable, str(tool), str(src), str(cache_dir())], check=True,
                       stdout=subprocess.DEVNULL)
        return path
    from stowlm import pull  # the real download path users take

    return Path(pull.pull(name))


def load_fixture(name: str):
    with open(FIXTURES / f"{name}.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="session")
def model_path():
    return get_model


def subprocess_env(**extra) -> dict:
    """Environment for a child Python that must import the same stowlm as this test run
    (the installed package in CI, python/ in a development build)."""
    import stowlm

    pkg_parent = str(Path(stowlm.__file__).resolve().parent.parent)
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [pkg_parent, env.get("PYTHONPATH", "")] if p)
    return env


# ---- CUDA devices in tests -------------------------------------------------------------------
# Tests parametrised over devices skip their CUDA cases, printing why, where stowlm was built
# without CUDA or no device is present; STOWLM_REQUIRE_GPU=1 (GPU CI) turns that skip into a
# failure.
REQUIRE_GPU = os.environ.get("STOWLM_REQUIRE_GPU") == "1"


@functools.lru_cache(maxsize=1)
def cuda_skip_reason():
    """None when CUDA device 0 can run tests, else why not."""
    from stowlm import _core

    if not hasattr(_core, "cuda_ops"):
        return "stowlm was built without CUDA (nvcc not found at build time)"
    devices, why = _core.cuda.devices()
    if not devices:
        return f"no CUDA device: {why}"
    return None


def require_devices(*names):
    """Skip (or, with STOWLM_REQUIRE_GPU=1, fail) the calling test when any of the device specs
    `names` is a CUDA device this machine cannot offer."""
    if not any(str(n).startswith("cuda") for n in names):
        return
    why = cuda_skip_reason()
    if why:
        if REQUIRE_GPU:
            pytest.fail(f"STOWLM_REQUIRE_GPU=1 but {why}")
        print(f"skipping {', '.join(map(str, names))}: {why}")
        pytest.skip(why)
