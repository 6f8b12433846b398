"""How far one device's own kernels for two instruction sets disagree: the fixture prompts'
logits with STOWLM_ISA=a against STOWLM_ISA=b (each in a process of its own), as mean KL and
top-1 agreement. This is the noise floor of any change that re-associates sums (a tensor split
that adds partial products lands at the same level).

    python bench/isa_kl.py [-m NAME ...] [--isa avx512 avx2]
"""
import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")


def _logits(name, out):
    sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "python")]
    import stowlm
    from conftest import get_model, load_fixture

    model = stowlm.Model(str(get_model(name)))
    prompts = [r["ids"] for r in load_fixture(name) if r["kind"] == "logits"]
    np.save(out, np.concatenate([stowlm.Context(model, n_ctx=256).eval(p, logits="all") for p in prompts]))


def _logsoftmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", action="append", help="a model of shared/models.md (default: three dense ones)")
    ap.add_argument("--isa", nargs=2, default=["avx512", "avx2"])
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # internal: NAME OUT in this process
    a = ap.parse_args()
    if a.one:
        return _logits(*a.one)
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.model or ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"]:
            got = []
            for isa in a.isa:
                out = os.path.join(tmp, f"{isa}.npy")
                subprocess.run([sys.executable, __file__, "--one", name, out], check=True,
                               env=dict(os.environ, STOWLM_ISA=isa))
                got.append(np.load(out).astype(np.float64))
            p, q = _logsoftmax(got[0]), _logsoftmax(got[1])
            kl = (np.exp(p) * (p - q)).sum(-1).mean()
            top1 = (got[0].argmax(-1) == got[1].argmax(-1)).mean()
            print(f"{name}: {a.isa[0]} vs {a.isa[1]}: mean KL {kl:.2e}, top-1 {top1:.3f} over {len(p)} positions")


if __name__ == "__main__":
    main()
