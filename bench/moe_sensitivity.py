"""How sensitive a GGUF model (any architecture stowlm runs, dense or with experts) is to tiny
numerical noise.

Runs the independent float64 numpy forward pass of tests/float_reference.py over the prompts of a
llama.cpp fixture twice:
exactly, and with the residual stream multiplied by (1 + eps * N(0, 1)) after every layer (eps
1e-3 is far below the error of 8-bit activation rounding that every quantized engine makes). It
prints KL / top-1 of the noisy pass, stowlm and optionally llama.cpp logits (dumped by
bench/peer/llama_logits.cpp) against the exact pass, and of each of them against the fixture.

A model whose top-k routing sits on near-ties flips experts under that noise and its later
positions decorrelate, so no engine that is not bit-identical with the fixture's run could match
them; a dense model does not move. The first smollm2-moe (a random router picking 6 of 8 experts
at ~0.125 each) was such a model: KL 0.18 between the exact and the noisy pass. Today's
smollm2-moe (mirror-pair experts, ../shared/tools/make_moe_models.py) is not: KL 0.0004, top-1
100% (2026-11-24), so its fixture is compared at every position in tests/test_moe.py.

    python bench/moe_sensitivity.py smollm2-moe [--eps 1e-3] [--peer NAME=FILE.bin ...]
"""
import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "python"), os.path.join(HERE, "..", "tests")]
import stowlm  # noqa: E402
from float_reference import FloatModel  # noqa: E402

SHARED = os.environ.get("STOWLM_SHARED", os.path.join(os.path.dirname(__file__), "..", "..", "shared"))
CACHE = os.environ.get("STOWLM_CACHE", os.path.expanduser("~/.cache/stowlm/models"))


def forward(path, prompts, eps=0.0, seed=0):
    """The float64 pass of tests/float_reference.py over every prompt, optionally with noise."""
    model, rng = FloatModel(path), np.random.default_rng(seed)
    return [model.logits(ids, eps=eps, rng=rng) for ids in prompts]


def log_softmax(a):
    a = np.asarray(a, np.float64)
    m = a.max(-1, keepdims=True)
    return a - m - np.log(np.exp(a - m).sum(-1, keepdims=True))


def vs_fixture(records, logits):
    """Mean KL(P_ref || P) over the reference's top 40 and top-1 agreement, every position."""
    kls, top1 = [], []
    for r, rows in zip(records, logits):
        for row, p in zip(log_softmax(rows), r["positions"]):
            ref = np.array(p["logits"]) - p["lse"]
            kls.append(float((np.exp(ref) * (ref - row[p["ids"]])).sum()))
            top1.append(int(np.argmax(row)) == p["ids"][0])
    return np.mean(kls), np.mean(top1)


def between(a, b):
    """Mean full-vocabulary KL(P_a || P_b) and top-1 agreement."""
    pa, pb = log_softmax(np.concatenate(a)), log_softmax(np.concatenate(b))
    return (np.exp(pa) * (pa - pb)).sum(-1).mean(), np.mean(pa.argmax(-1) == pb.argmax(-1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="fixture name (smollm2-135m, smollm2-moe, glm4moe-tiny, ...)")
    ap.add_argument("--eps", type=float, default=1e-3, help="relative noise per layer")
    ap.add_argument("--peer", action="append", default=[], metavar="NAME=FILE",
                    help="float32 logits [positions, vocab] of every fixture prompt, concatenated")
    a = ap.parse_args()
    records = [json.loads(line) for line in open(os.path.join(SHARED, "fixtures", a.model + ".jsonl"))]
    records = [r for r in records if r["kind"] == "logits"]
    prompts = [r["ids"] for r in records]
    path = os.path.join(CACHE, a.model + ".gguf")
    exact, noisy = forward(path, prompts), forward(path, prompts, eps=a.eps)
    model = stowlm.Model(path)
    ours = [stowlm.Context(model, n_ctx=256).eval(ids, logits="all") for ids in prompts]
    print(f"{a.model}: {sum(map(len, prompts))} positions")
    rows = [("float64", exact), (f"float64 + {a.eps:g} noise", noisy), ("stowlm", ours)]
    vocab = exact[0].shape[1]
    for spec in a.peer:
        name, fn = spec.split("=", 1)
        flat, out, o = np.fromfile(fn, np.float32).reshape(-1, vocab), [], 0
        for ids in prompts:
            out.append(flat[o:o + len(ids)])
            o += len(ids)
        rows.append((name, out))
    print("  against the exact float64 pass (full-vocabulary KL, top-1):")
    for name, lg in rows[1:]:
        kl, t1 = between(exact, lg)
        print(f"    {name:>28}: KL {kl:.4f}, top-1 {t1:.1%}")
    print("  against the fixture (KL over its top 40, top-1):")
    for name, lg in rows:
        kl, t1 = vs_fixture(records, lg)
        print(f"    {name:>28}: KL {kl:.4f}, top-1 {t1:.1%}")

if __name__ == "__main__":
    main()
