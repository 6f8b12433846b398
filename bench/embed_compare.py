"""Embeddings of stowlm against a llama.cpp-family `llama-embedding` and a float64 pass of the file.

    python bench/embed_compare.py --peer PATH/llama-embedding -m MODEL.gguf [MODEL.gguf ...]

For each model, pooling (mean, last) and text: the cosine of stowlm's normalized vector with the
peer's (`--pooling P --embd-normalize 2`, the text as one prompt), and of each with the mean of a
float64 pass's hidden states (tests/float_reference.py; mean pooling only)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

TEXTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b",
         "Paris is the capital of France, a country in Europe."]


def peer_vector(peer: str, model: str, text: str, pooling: str, threads: int) -> np.ndarray:
    out = subprocess.run([peer, "-m", model, "-p", text, "--pooling", pooling, "--embd-normalize", "2",
                          "--embd-output-format", "json", "-t", str(threads), "-c", "512",
                          "--embd-separator", "<#no-split#>"], capture_output=True, text=True, check=True)
    v = np.array(json.loads(out.stdout)["data"][0]["embedding"], dtype=np.float64)
    return v / np.linalg.norm(v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer", required=True, help="llama.cpp's or ik_llama.cpp's llama-embedding")
    ap.add_argument("-m", "--model", nargs="+", required=True)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--no-float", action="store_true", help="skip the float64 pass (slow on large models)")
    a = ap.parse_args()

    import stowlm

    print("model | pooling | stowlm~peer per text | stowlm~f64 | peer~f64")
    for model in a.model:
        fm = None
        if not a.no_float:
            from float_reference import FloatModel
            fm = FloatModel(model)
        for pooling in ("mean", "last"):
            with stowlm.LLM(model, embedding=True, pooling=pooling, n_ctx=512, n_threads=a.threads,
                            progress=False) as llm:
                peer_cos, f_mine, f_peer = [], [], []
                for text in TEXTS:
                    mine = np.asarray(llm.embed(text), dtype=np.float64)
                    ref = peer_vector(a.peer, model, text, pooling, a.threads)
                    peer_cos.append(float(mine @ ref))
                    if fm is not None and pooling == "mean":
                        f = fm.hidden(llm.tokenize(text), kv_f16=True).mean(0)
                        f /= np.linalg.norm(f)
                        f_mine.append(float(mine @ f))
                        f_peer.append(float(ref @ f))
            fmt = lambda xs: ", ".join(f"{x:.6f}" for x in xs) or "-"  # noqa: E731
            print(f"{os.path.basename(model)} | {pooling} | {fmt(peer_cos)} | {fmt(f_mine)} | {fmt(f_peer)}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
