"""The CUDA backend's engine side without a GPU: tests/native/cuda_engine_emulated.cpp runs
cuda/cuda_engine.cpp against an emulated device (host memory; each launcher checks that every
pointer it gets is device memory, then runs the CPU kernel it mirrors) and compares dense and MoE
models on cuda:0, cpu:0 + cuda:0 splits, two CUDA devices and experts on the other device with the
CPU backend's logits, plus exact memory accounting and the split-KV decode path; gpt-oss, deepseek2
and glm4moe with every node on cuda:0; contexts of four sequences (fixed KV splits, sequence
masks) against the CPU's; the launch counter (kernels per decode step against a count from the
architecture) and stowlm-bench -v's kernel report built on the same device. It links the core
library of a CUDA-enabled build (whose make_backend creates the CUDA backend); skipped, with the
reason, where there is none (set STOWLM_CUDA_BUILD_DIR to point at one)."""
import json
import os
import re
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


def build_emulated(main_source, exe):
    """Links main_source (a path in the repo) with the emulated device and cuda/cuda_engine.cpp
    against a CUDA-enabled build's core library (skipped, with the reason, where there is no such
    build or no C++ compiler)."""
    build = cuda_build_dir()
    if build is None:
        pytest.skip("no CUDA-enabled build directory (cmake -S . -B build-cuda -DSTOWLM_CUDA=ON)")
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    cmd = [cxx, "-O2", "-std=c++17", "-Wall", "-Wextra", "-Wno-unused-parameter", f"-I{REPO / 'csrc'}",
           f"-I{REPO / 'cuda'}", str(REPO / main_source),
           str(REPO / "tests/native/emulated_cuda.cpp"), str(REPO / "cuda/cuda_engine.cpp"),
           str(build / "libstowlm_core.a"), "-lpthread", "-ldl", "-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0 and not r.stderr.strip(), f"build failed or warned:\n{r.stderr}"
    return exe


def build_and_run(program, models, model_path, tmp_path, timeout):
    """Builds tests/native/<program>.cpp on the emulated device (build_emulated), runs it on the
    models' directory, and checks that it reports no failure."""
    exe = build_emulated(f"tests/native/{program}.cpp", tmp_path / program)
    model_dir = {str(model_path(m).parent) for m in models}
    assert len(model_dir) == 1
    r = subprocess.run([str(exe), model_dir.pop()], capture_output=True, text=True, timeout=timeout)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 failure(s)" in r.stdout


def test_cuda_engine_on_an_emulated_device(model_path, tmp_path):
    build_and_run("cuda_engine_emulated", MODELS, model_path, tmp_path, timeout=300)


# A llama layer's decode step launches 9 kernels: the q, k and v products in one launch on the
# q8_1 rows attn_norm wrote beside its output; attention, writing its output's q8_1 rows too;
# attn_output on them; ffn_down, quantizing its input first; gate, up and swiglu in one kernel on
# the rows ffn_norm quantized; the q and k ropes and the K and V stores in one launch; two
# residual adds, each fused with the norm after it. The first layer's attn_norm follows no add (one more kernel).
# The tied output: the embedding rows, the output rows, output_norm (with its q8_1 rows) and the
# logits' product (models/blocks.cpp; tests/native/cuda_engine_emulated.cpp counts them one by one).
LLAMA_LAYER_KERNELS, LLAMA_TIED_OUTPUT_KERNELS = 9, 4


def test_bench_kernel_report_on_an_emulated_device(model_path, tmp_path):
    """stowlm-bench -v on a CUDA device: kernels per generated token (per run for a prompt) and
    the wall time per token split into kernels run back to back and the rest, from the emulated
    device's counter and timed spans; the counts follow the architecture whatever the length, and
    a decode step is one CUDA graph launch once its shape has run twice; then each op's kernels (a
    replayed graph's) timed under its label."""
    import gguf

    exe = build_emulated("bench/stowlm_bench.cpp", tmp_path / "stowlm-bench-emulated")
    path = model_path("smollm2-135m")
    n_layer = int(gguf.GGUFReader(str(path)).fields["llama.block_count"].parts[-1][0])
    expected = 1 + n_layer * LLAMA_LAYER_KERNELS + LLAMA_TIED_OUTPUT_KERNELS
    line_re = re.compile(r"^  (\S+) on cuda:0: ([\d.]+) kernels per (token|run); ([\d.]+) ms per \3, of which "
                         r"([\d.]+) ms in kernels \(run back to back\) and (-?[\d.]+) ms \((-?\d+)%\) outside them "
                         r".*host launches per \3: ([\d.]+) CUDA graphs and ([\d.]+) kernels$")
    for n_gen in (2, 5):
        r = subprocess.run([str(exe), "-m", str(path), "-dev", "cuda:0", "-p", "8", "-n", str(n_gen), "-r", "1",
                            "-o", "json", "-v", "--no-warmup"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        rows = {row["n_gen"]: row for row in json.loads(r.stdout)}
        found = [line_re.match(ln) for ln in r.stderr.splitlines() if " kernels per " in ln]
        assert len(found) == 2 and all(found), r.stderr
        for m in found:
            test, kernels, unit, wall, inside, outside, share, graphs, direct = m.groups()
            assert float(kernels) == expected, (test, kernels, expected)
            if unit == "token":  # the timed run comes after the repetitions: every step replays its graph
                assert (float(graphs), float(direct)) == (1.0, 0.0), m.group(0)
            assert unit == ("token" if test.startswith("tg") else "run")
            assert float(outside) == pytest.approx(float(wall) - float(inside), abs=0.0015)
            assert float(inside) > 0
            # one repetition: the wall time per token (per run) is the inverse of the table's rate
            row = rows[n_gen if test.startswith("tg") else 0]
            per = row["n_gen"] if unit == "token" else 1
            assert float(wall) == pytest.approx(1e3 * (row["n_prompt"] + row["n_gen"]) / row["avg_ts"] / per, rel=2e-3)
        # each op's kernels timed under its label: the prompt's ops (run directly), a decode step's graph
        lines = r.stderr.splitlines()
        for m in found:
            at = lines.index(m.group(0))
            ops = {}
            for ln in lines[at + 1:]:
                op = re.match(r"^    (\S.*?) +([\d.]+) ms +[\d.]+%  +([\d.]+) calls$", ln)
                if not op:
                    break
                ops[op.group(1)] = (float(op.group(2)), float(op.group(3)))
            inside = float(m.group(5))
            assert sum(ms for ms, _ in ops.values()) == pytest.approx(inside, rel=0.02, abs=0.002), ops
            if m.group(3) == "run":
                assert ops["flash_attn"][1] == ops["ffn_down.weight"][1] == n_layer, ops
                assert ops["ffn_gate.weight+ffn_up.weight+swiglu"][1] == n_layer, ops
            else:
                assert list(ops) == [f"CUDA graph of {expected} kernels"] and ops[list(ops)[0]][1] == 1.0, ops
