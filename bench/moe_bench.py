"""Mixture-of-experts throughput: pp512 (one 512-token prompt) and tg128 (128 tokens generated one
at a time after it) for a MoE model, plus the weight bytes one generated token reads against the
model's total: every dense weight, the output head, and per layer only the k picked experts'
rows of the expert stacks (mul_mat_id reads no other expert).

usage: python bench/moe_bench.py [MODEL.gguf|NAME] [--threads N] [--reps R]"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import stowlm  # noqa: E402
from stowlm.gguffile import GGUFFile  # noqa: E402


def bytes_per_token(path):
    f = GGUFFile(path)
    arch = f.metadata["general.architecture"]
    n_expert = int(f.metadata.get(f"{arch}.expert_count", 0))
    k = int(f.metadata.get(f"{arch}.expert_used_count", 0))
    tensors = {t.name: t for t in f.tensors}
    tied = "output.weight" not in tensors
    total = touched = 0
    for name, t in tensors.items():
        nbytes = t.nbytes
        total += nbytes
        if name.endswith("_exps.weight"):
            touched += nbytes * k // n_expert  # k distinct experts of n_expert, whole matrices
        elif name == "token_embd.weight" and not tied:
            touched += nbytes // t.shape[0]  # one row looked up
        else:
            touched += nbytes
    return touched, total, k, n_expert


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-moe")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    path = a.model
    if not path.endswith(".gguf"):
        from conftest import get_model
        path = str(get_model(path))
    dev = f"cpu:0[threads={a.threads}]" if a.threads else "cpu:0"
    model = stowlm.Model(path, devices=[dev])
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, model.n_vocab - 100, 512).tolist()
    pp, tg = [], []
    for _ in range(a.reps):
        ctx = stowlm.Context(model, n_ctx=1024, n_ubatch=512)
        t = time.perf_counter()
        logits = ctx.eval(prompt)
        pp.append(512 / (time.perf_counter() - t))
        tok = int(np.argmax(logits))
        t = time.perf_counter()
        for _ in range(128):
            tok = int(np.argmax(ctx.eval([tok])))
        tg.append(128 / (time.perf_counter() - t))
    touched, total, k, n_expert = bytes_per_token(path)
    print(f"model {Path(path).name} ({model.arch}, {k} of {n_expert} experts), device {dev}")
    print(f"pp512: {max(pp):8.1f} tok/s")
    print(f"tg128: {max(tg):8.1f} tok/s")
    print(f"weights read per generated token: {touched / 2**20:.1f} MiB of {total / 2**20:.1f} MiB "
          f"({touched / total:.1%})")


if __name__ == "__main__":
    main()
