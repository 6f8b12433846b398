"""Shared test fixtures: real models (pulled once into the stowlm cache) and llama.cpp fixtures."""
import functools
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _shared_dir() -> Path:
    """../shared beside the checkout ($STOWLM_SHARED overrides); a clone of a local checkout
    (`git clone . /tmp/x`) finds it beside the checkout it was cloned from."""
    if "STOWLM_SHARED" in os.environ:
        return Path(os.environ["STOWLM_SHARED"])
    here = REPO.parent / "shared"
    if here.is_dir():
        return here
    try:
        origin = subprocess.run(["git", "-C", str(REPO), "config", "--get", "remote.origin.url"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        origin = ""
    beside = Path(origin).resolve().parent / "shared" if origin and os.path.isdir(origin) else None
    return beside if beside is not None and beside.is_dir() else here


SHARED = _shared_dir()
FIXTURES = SHARED / "fixtures"
DENSE_MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"]
ARCH_MODELS = ["gptoss-tiny", "deepseek2-tiny", "glm4moe-tiny"]  # the big-MoE architectures in small
MOE_MODELS = ["smollm2-moe", "qwen3moe-tiny"] + ARCH_MODELS
# Test models the shared tools write (deterministic: ../shared/models.md lists their sha256). A
# cached file of an older version of a tool is made again.
GENERATED = {
    "smollm2-moe": ("make_moe_models.py", "b987b3a3445955f79643ff07ccd29438056b297b63b7327e8ac9a52e6ceb946d"),
    "qwen3moe-tiny": ("make_moe_models.py", "232e70ced29fcb8393e10e2f877d0b95dee07df4f4bf45ae6da1468d98934f5d"),
    "gptoss-tiny": ("make_arch_models.py", "625b5d30ed66aba1867a0fba1b8c905d6c1203944a43cbec4d9d1a336b7b6dc5"),
    "deepseek2-tiny": ("make_arch_models.py", "a000e383e12dc36b207820884fbb614d059584e4748989849127be2d23d8f6b9"),
    "glm4moe-tiny": ("make_arch_models.py", "bdd114262527f37a3ed83f76d431bfd622d978dfbc11ea24d6c724437a776d1f"),
}


def cache_dir() -> Path:
    return Path(os.environ.get("STOWLM_CACHE", Path.home() / ".cache" / "stowlm")) / "models"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def get_model(name: str) -> Path:
    """Path of a model of shared/models.md, pulled (or, for the test models, generated) once."""
    path = cache_dir() / f"{name}.gguf"
    if name in GENERATED:
        tool, sha = GENERATED[name]
        if not path.exists() or _sha256(path) != sha:
            src = get_model("smollm2-135m")
            subprocess.run([sys.executable, str(SHARED / "tools" / tool), str(src), str(cache_dir())], check=True,
                           stdout=subprocess.DEVNULL)
            assert _sha256(path) == sha, f"{tool} wrote {path} with another sha256 than ../shared/models.md lists"
        return path
    if path.exists():
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


def start_server(model, *args):
    """`stowlm serve MODEL --port 0 -q ARGS` as a subprocess of the same stowlm: (process, port).
    Its stderr is drained from then on (proc.rest_of_stderr) so it never blocks on a full pipe."""
    import re
    import threading
    import time

    env = subprocess_env()
    env.pop("STOWLM_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "stowlm", "serve", str(model), "--port", "0", "-q", *args],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    deadline = time.time() + 120
    lines = []
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        if m:
            rest = []
            threading.Thread(target=lambda: rest.extend(proc.stderr), daemon=True).start()
            proc.rest_of_stderr = rest
            return proc, int(m.group(1))
    proc.kill()
    raise RuntimeError("the server did not start:\n" + "".join(lines))


def stop_server(proc) -> int:
    """Ctrl-C, as a user stops it; the exit status."""
    import signal

    proc.send_signal(signal.SIGINT)
    try:
        rc = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    return rc


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
