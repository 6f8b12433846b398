"""How sensitive a llama-architecture GGUF (dense or with experts) is to tiny numerical noise.

Runs an independent float64 numpy forward pass over the prompts of a llama.cpp fixture twice:
exactly, and with the residual stream multiplied by (1 + eps * N(0, 1)) after every layer (eps
1e-3 is far below the error of 8-bit activation rounding that every quantized engine makes). It
prints KL / top-1 between the two passes, and of each engine's logits (exact pass, stowlm, and
optionally llama.cpp logits dumped by bench/peer/llama_logits.cpp) against the fixture.

A model whose top-k routing sits on near-ties (smollm2-moe: a random router picks 6 of 8 experts
with probabilities ~0.125 each) flips experts under that noise and its later positions decorrelate;
a dense model does not move. So for such a model no engine that is not bit-identical with the
fixture's run can match its later positions, llama.cpp itself in another mode included.

    python bench/moe_sensitivity.py smollm2-moe [--eps 1e-3] [--peer NAME=FILE.bin ...]
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
import stowlm  # noqa: E402
from stowlm.quants import dequantize  # noqa: E402

SHARED = os.environ.get("STOWLM_SHARED", os.path.join(os.path.dirname(__file__), "..", "..", "shared"))
CACHE = os.environ.get("STOWLM_CACHE", os.path.expanduser("~/.cache/stowlm/models"))


def forward(path, prompts, eps=0.0, seed=0):
    """float64 llama forward pass (adjacent-pair rope, GQA, causal softmax; softmax router over
    all experts, top k, renormalised, SiLU-gated experts), logits for every position."""
    f = stowlm.GGUFFile(path)
    md, info = f.metadata, {t[0]: t for t in f.tensors}
    cache = {}

    def W(n):
        if n not in cache:
            t = info[n]
            cache[n] = dequantize(f.tensor_data(n), t[1], t[2]).astype(np.float64)
        return cache[n]

    E, L = md["llama.embedding_length"], md["llama.block_count"]
    H, HKV = md["llama.attention.head_count"], md["llama.attention.head_count_kv"]
    D, eps_n, base = E // H, md["llama.attention.layer_norm_rms_epsilon"], md["llama.rope.freq_base"]
    k = md.get("llama.expert_used_count", 0)
    rng = np.random.default_rng(seed)

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps_n) * w

    def rope(x, pos):
        th = pos[:, None] * base ** (-2.0 * np.arange(D // 2) / D)
        c, s = np.cos(th)[:, None, :], np.sin(th)[:, None, :]
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
        return out

    def silu(g):
        return g / (1 + np.exp(-g))

    results = []
    for ids in prompts:
        n, pos = len(ids), np.arange(len(ids), dtype=np.float64)
        x = W("token_embd.weight")[ids]
        for il in range(L):
            p = f"blk.{il}."
            h = rms(x, W(p + "attn_norm.weight"))
            q = rope((h @ W(p + "attn_q.weight").T).reshape(n, H, D), pos)
            kk = rope((h @ W(p + "attn_k.weight").T).reshape(n, HKV, D), pos)
            v = (h @ W(p + "attn_v.weight").T).reshape(n, HKV, D)
            o = np.zeros((n, H, D))
            for hh in range(H):
                g = hh // (H // HKV)
                sc = q[:, hh] @ kk[:, g].T / np.sqrt(D)
                sc[np.triu_indices(n, 1)] = -np.inf
                pr = np.exp(sc - sc.max(1, keepdims=True))
                o[:, hh] = (pr / pr.sum(1, keepdims=True)) @ v[:, g]
            x = x + o.reshape(n, E) @ W(p + "attn_output.weight").T
            h = rms(x, W(p + "ffn_norm.weight"))
            if not k:
                x = x + (silu(h @ W(p + "ffn_gate.weight").T) * (h @ W(p + "ffn_up.weight").T)) @ W(p + "ffn_down.weight").T
            else:
                gi = h @ W(p + "ffn_gate_inp.weight").T
                pr = np.exp(gi - gi.max(1, keepdims=True))
                pr /= pr.sum(1, keepdims=True)
                ge, ue, de = (W(p + f"ffn_{t}_exps.weight") for t in ("gate", "up", "down"))
                for t in range(n):
                    sel = np.argsort(-pr[t], kind="stable")[:k]
                    for e, we in zip(sel, pr[t, sel] / pr[t, sel].sum()):
                        x[t] += we * (de[e] @ (silu(ge[e] @ h[t]) * (ue[e] @ h[t])))
            if eps:
                x = x * (1 + eps * rng.standard_normal(x.shape))
        x = rms(x, W("output_norm.weight"))
        results.append(x @ (W("output.weight") if "output.weight" in info else W("token_embd.weight")).T)
    return results


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
    ap.add_argument("model", help="fixture name (smollm2-135m, smollm2-moe)")
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
    kl, t1 = between(exact, noisy)
    print(f"{a.model}: {sum(map(len, prompts))} positions")
    print(f"  float64 vs float64 with {a.eps:g} relative noise per layer: KL {kl:.4f}, top-1 {t1:.1%}")
    print(f"  stowlm vs float64: KL {between(exact, ours)[0]:.4f}, top-1 {between(exact, ours)[1]:.1%}")
    rows = [("float64", exact), (f"float64 + {a.eps:g} noise", noisy), ("stowlm", ours)]
    vocab = exact[0].shape[1]
    for spec in a.peer:
        name, fn = spec.split("=", 1)
        flat, out, o = np.fromfile(fn, np.float32).reshape(-1, vocab), [], 0
        for ids in prompts:
            out.append(flat[o:o + len(ids)])
            o += len(ids)
        rows.append((name, out))
    print("  against the fixture (KL over its top 40, top-1):")
    for name, lg in rows:
        kl, t1 = vs_fixture(records, lg)
        print(f"    {name:>28}: KL {kl:.4f}, top-1 {t1:.1%}")


if __name__ == "__main__":
    main()
