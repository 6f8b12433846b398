"""What a decode step costs with several sequences: one eval_batch of one token for each of n
sequences of one context (the server's step), against one sequence alone, at a given depth.

    python bench/batch_decode.py -m ~/.cache/stowlm/models/smollm2-135m.gguf -n 1,4 --depth 60

Each sequence first holds `depth` prompt tokens; every 40 steps they are cut back to it, so the
attention sees depth to depth + 40 cells. Prints ms per step and per token (median of rounds).
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import stowlm  # noqa: E402


def step_ms(model, n_seq, depth, steps, threads):
    devices = [f"cpu:0[threads={threads}]"] if threads else None
    ctx = stowlm.Context(stowlm.Model(model, devices=devices), n_ctx=1024 * n_seq, n_seq=n_seq)
    for s in range(n_seq):
        ctx.eval_batch(list(range(1, depth + 1)), [s] * depth)
    toks, seqs = [7] * n_seq, list(range(n_seq))
    t0 = time.perf_counter()
    for i in range(steps):
        ctx.eval_batch(toks, seqs, rows=seqs)
        if i % 40 == 39:
            for s in seqs:
                ctx.kv_truncate(depth, seq=s)
    return (time.perf_counter() - t0) / steps * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-n", "--n-seq", default="1,4", help="sequences per step, comma list")
    ap.add_argument("--depth", type=int, default=60)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=None)
    args = ap.parse_args()
    ns = [int(x) for x in args.n_seq.split(",")]
    res = {n: [] for n in ns}
    for _ in range(args.rounds):  # alternating, so drift treats the sizes alike
        for n in ns:
            res[n].append(step_ms(args.model, n, args.depth, args.steps, args.threads))
    with open("/proc/cpuinfo") as f:
        cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "?")
    print(f"CPU: {cpu}; {os.path.basename(args.model)}; depth {args.depth}")
    for n in ns:
        ms = statistics.median(res[n])
        print(f"  {n} sequence(s): {ms:.2f} ms a step, {ms / n:.2f} ms a token  (rounds: "
              f"{', '.join(f'{x:.2f}' for x in res[n])})")


if __name__ == "__main__":
    main()
