"""The CUDA backend's engine side without a GPU: tests/native/cuda_engine_emulated.cpp runs
cuda/cuda_engine.cpp against an emulated device (host memory; each launcher checks that every
pointer it gets is device memory, then runs the CPU kernel it mirrors) and compares dense and MoE
models on cuda:0, cpu:0 + cuda:0 splits, two CUDA devices and experts on the other device with the
CPU backend's logits, plus exact memory accounting and the split-KV decode path; gpt-oss, deepseek2
and glm4moe with every node on cuda:0; contexts of four sequences (fixed KV splits, sequence
masks) against the CPU's. It links the core
library of a CUDA-enabled build (whose make_backend creates the CUDA backend); skipped, with the
reason, where there is none (set STOWLM_CUDA_BUILD_DIR to point at one)."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen3moe-tiny", "smollm2-moe", "gptoss-tiny",
          "deepseek2-tiny", "glm4moe-tiny"]


def cuda_build_dir():
    """A build directory configured with the CUDA backend and holding libstowlm_core.a."""
    env = os.environ.get("STOWLM_CUDA_BUILD_DIR")
    # pip's build (pyproject build-dir) lands in build/<wheel tag>; dev builds in build*/.
    candidates = [Path(env)] if env else sorted(REPO.glob("build*")) + sorted(REPO.glob("build/*/"))
    for d in candidates:
        cache = d / "CMakeCache.txt"
        if not (d / "libstowlm_core.a").exists() or not cache.exists():
            continue
        text = cache.read_text(errors="replace")
        if "STOWLM_CUDA:BOOL=ON" in text and (d / "libstowlm_cuda.a").exists():
            return d
    return None


def build_and_run(program, models, model_path, tmp_path, timeout):
    """Builds tests/native/<program>.cpp with the emulated device and cuda/cuda_engine.cpp against a
    CUDA-enabled build's core library, runs it on the models' directory, and checks that it reports
    no failure (skipped, with the reason, where there is no such build or no C++ compiler)."""
    build = cuda_build_dir()
    if build is None:
        pytest.skip("no CUDA-enabled build directory (cmake -S . -B build-cuda -DSTOWLM_CUDA=ON)")
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path / program
    cmd = [cxx, "-O2", "-std=c++17", "-Wall", "-Wextra", "-Wno-unused-parameter", f"-I{REPO / 'csrc'}",
           f"-I{REPO / 'cuda'}", str(REPO / f"tests/native/{program}.cpp"),
           str(REPO / "tests/native/emulated_cuda.cpp"), str(REPO / "cuda/cuda_engine.cpp"),
           str(build / "libstowlm_core.a"), "-lpthread", "-ldl", "-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0 and not r.stderr.strip(), f"build failed or warned:\n{r.stderr}"
    model_dir = {str(model_path(m).parent) for m in models}
    assert len(model_dir) == 1
    r = subprocess.run([str(exe), model_dir.pop()], capture_output=True, text=True, timeout=timeout)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 failure(s)" in r.stdout


def test_cuda_engine_on_an_emulated_device(model_path, tmp_path):
    build_and_run("cuda_engine_emulated", MODELS, model_path, tmp_path, timeout=300)
