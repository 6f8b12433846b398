"""CUDA code checks that need no GPU: every .cu under cuda/ compiles for each default
architecture, and ptxas' resource report shows no register spills to local memory and shared
memory within each architecture's limit. Also: the package behaves well without a GPU."""
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stowlm import _core

REPO = Path(__file__).resolve().parent.parent
ARCHS = [80, 86, 89, 90]
# Shared memory a block may use (opt-in maximum), bytes, per architecture.
SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


def ptxas_report(src: Path, arch: int) -> str:
    cmd = [NVCC, "-cubin", "-o", os.devnull, f"-arch=sm_{arch}", "-std=c++17", "-O3",
           f"-I{REPO / 'csrc'}", f"-I{REPO / 'cuda'}", "-Xptxas=-v", str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"nvcc failed for {src.name} sm_{arch}:\n{r.stderr}"
    return r.stderr


def parse_report(text: str):
    """{kernel: {"spill_stores", "spill_loads", "smem", "registers"}} from ptxas -v output."""
    kernels = {}
    current = None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line) or re.search(r"Function properties for (\S+)", line)
        if m:
            current = kernels.setdefault(m.group(1), {"spill_stores": 0, "spill_loads": 0, "smem": 0, "registers": 0})
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            current["spill_stores"] = int(m.group(1))
            current["spill_loads"] = int(m.group(2))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current["registers"] = int(m.group(1))
        m = re.search(r"(\d+) bytes smem", line)
        if m:
            current["smem"] = int(m.group(1))
    return kernels


CU_FILES = sorted((REPO / "cuda").glob("*.cu"))


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: the CUDA backend is not built here")
def test_kernels_have_no_spills_and_fit_shared_memory():
    jobs = [(src, arch) for src in CU_FILES for arch in ARCHS]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as ex:
        reports = list(ex.map(lambda j: (j, ptxas_report(*j)), jobs))
    n_kernels = 0
    problems = []
    for (src, arch), text in reports:
        for name, k in parse_report(text).items():
            n_kernels += 1
            if k["spill_stores"] or k["spill_loads"]:
                problems.append(f"{src.name} sm_{arch} {name}: spills {k['spill_stores']}B stores/{k['spill_loads']}B loads")
            if k["smem"] > SMEM_LIMIT[arch]:
                problems.append(f"{src.name} sm_{arch} {name}: {k['smem']} B shared memory > {SMEM_LIMIT[arch]}")
    assert n_kernels > 0, "ptxas reported no kernels: the report format changed?"
    assert not problems, "\n".join(problems)


def test_parse_report_sees_spills():
    sample = ("ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_80'\n"
              "ptxas info    : Function properties for _Z3fooPf\n"
              "    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
              "ptxas info    : Used 255 registers, 49152 bytes smem, 360 bytes cmem[0]\n")
    k = parse_report(sample)["_Z3fooPf"]
    assert k == {"spill_stores": 4, "spill_loads": 4, "smem": 49152, "registers": 255}


def test_no_gpu_means_no_cuda_devices():
    devices, why = _core.cuda.devices()
    if devices:
        pytest.skip(f"this machine has CUDA devices: {[d['name'] for d in devices]}")
    assert why, "with no CUDA device the core must say why"
