"""Mean KL(llama.cpp || stowlm) over the recorded prompts of shared/fixtures, per model: a quick
check of how a kernel change moves the logits (the engine's tests/test_models.py asserts the
bounds). Usage: PYTHONPATH=python python3 bench/kl_vs_llama.py --fixtures DIR [model ...]
STOWLM_ISA=avx512 (etc.) picks the kernel path. Differences of ~0.001 in mean KL between two
builds can be noise: an ulp-level change flips some 8-bit activation roundings, which re-rolls
the quantization noise of every later layer."""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import stowlm  # noqa: E402
from test_models import compare  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("models", nargs="*", default=["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"])
ap.add_argument("--fixtures", default=os.environ.get("STOWLM_FIXTURES", "/work/shared/fixtures"))
ap.add_argument("--models-dir", default=os.path.expanduser("~/.cache/stowlm/models"))
args = ap.parse_args()
for name in args.models:
    model = stowlm.Model(os.path.join(args.models_dir, f"{name}.gguf"), devices=["cpu:0[threads=1]"])
    ctx = stowlm.Context(model, n_ctx=256, n_ubatch=64)
    kl, gap = [], []
    with open(os.path.join(args.fixtures, f"{name}.jsonl")) as f:
        records = [r for r in map(json.loads, f) if r["kind"] == "logits"]
    for r in records:
        ctx.clear()
        g, k, _ = compare(ctx.eval(r["ids"], logits="all"), r["positions"])
        kl += k
        gap += g
    gap = np.array(gap)
    print(f"{name}: mean KL {np.mean(kl):.5f}, max KL {np.max(kl):.5f}, top-1 differs at {(gap > 0).sum()}/{len(gap)} "
          f"positions, largest llama.cpp gap there {gap.max():.3f}", flush=True)
