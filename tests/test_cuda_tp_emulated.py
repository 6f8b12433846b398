"""Tensor parallelism with CUDA devices without a GPU: tests/native/cuda_tp_emulated.cpp runs
cuda/cuda_engine.cpp's LOCAL_IDS and ALL_REDUCE (partials gathered by peer copies, uploads and
copy_to_host, summed in shard order) and the shard weights models/model_tp.cpp uploads, on the
emulated device of tests/native/emulated_cuda.cpp, for a dense model, an MoE model and an MLA MoE
model over [cuda:0, cuda:1], [cuda:0, cpu:0], [cpu:0, cuda:0] and [cuda:0, cpu:0, cuda:1], even and
uneven: the logits of the same split over CPU devices bit for bit, exact memory accounting. Like
tests/test_cuda_engine_emulated.py it links the core library of a CUDA-enabled build, and is
skipped, with the reason, where there is none."""
import os
import shutil
import subprocess

import pytest

from test_cuda_engine_emulated import REPO, cuda_build_dir

MODELS = ["smollm2-135m", "qwen3moe-tiny", "deepseek2-tiny", "gemma3-270m", "gptoss-tiny", "glm4moe-tiny"]


def test_tensor_parallel_on_emulated_cuda_devices(model_path, tmp_path):
    build = cuda_build_dir()
    if build is None:
        pytest.skip("no CUDA-enabled build directory (cmake -S . -B build-cuda -DSTOWLM_CUDA=ON)")
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path / "cuda_tp_emulated"
    cmd = [cxx, "-O2", "-std=c++17", "-Wall", "-Wextra", "-Wno-unused-parameter", f"-I{REPO / 'csrc'}",
           f"-I{REPO / 'cuda'}", str(REPO / "tests/native/cuda_tp_emulated.cpp"),
           str(REPO / "tests/native/emulated_cuda.cpp"), str(REPO / "cuda/cuda_engine.cpp"),
           str(build / "libstowlm_core.a"), "-lpthread", "-ldl", "-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0 and not r.stderr.strip(), f"build failed or warned:\n{r.stderr}"
    model_dir = {str(model_path(m).parent) for m in MODELS}
    assert len(model_dir) == 1
    r = subprocess.run([str(exe), model_dir.pop()], capture_output=True, text=True, timeout=600)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 failure(s)" in r.stdout
