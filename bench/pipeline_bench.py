"""Pipeline parallelism on CPU devices of unequal speed: fit proposes the layer split (stages
balanced by each device's threads within its memory), then a long prompt runs pipelined and
each device's busy time (its stage) is measured against the others.

    python bench/pipeline_bench.py [MODEL] [--devices "cpu:0[threads=2],cpu:1[threads=1]"]
                                   [--prompt 2048] [--ubatch 256] [--reps 3]

Prints fit's table and its expected time per stage, then per repetition the tokens/s and every
device's busy and idle share, and the slowest stage against the mean of the stages.
"""
import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
import stowlm  # noqa: E402
from stowlm import pull  # noqa: E402
from stowlm.fit import fit  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--devices", default="cpu:0[threads=2],cpu:1[threads=1]")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--ubatch", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    path = pull.pull(a.model, progress=False)
    p = fit(path, a.devices, n_ctx=a.prompt, n_ubatch=a.ubatch, n_outputs=1)
    print(p.table())
    print("\n".join(d for d in p.decisions if d.startswith(("expected time", "pipeline", "layers of"))))
    model = stowlm.Model(path, placement=p)
    ctx = stowlm.Context(model)
    ids = [(i * 7919) % model.n_vocab for i in range(a.prompt)]
    ctx.eval(ids)  # warm-up: graphs of every shape and slot
    ratios = []
    for rep in range(a.reps):
        ctx.clear()
        t0 = time.perf_counter()
        ctx.eval(ids)
        wall = time.perf_counter() - t0
        st = ctx.pipeline_stats
        busy = st["busy_s"]
        ratio = max(busy) / statistics.mean(busy)
        ratios.append(ratio)
        names = [d.name for d in p.used_devices]
        print(f"rep {rep}: {a.prompt / wall:.1f} tok/s, " + ", ".join(
            f"{n} busy {b:.3f} s (idle {100 * (1 - b / st['wall_s']):.1f}%)" for n, b in zip(names, busy)) +
            f"; slowest stage / mean {ratio:.3f}")
    print(f"slowest stage / mean of the stages: median {statistics.median(ratios):.3f} over {a.reps} runs "
          f"({p.layer_split} layers over {', '.join(d.spec for d in p.used_devices)}; "
          f"pipeline {ctx.pipeline})")


if __name__ == "__main__":
    main()
