"""Pipeline stages on MPI ranks: prompt throughput with and without overlapping micro-batches,
and what a generated token spends in messages.

    mpirun -np 2 python bench/mpi_bench.py MODEL [--threads 1] [--prompt 2048] [--ubatch 256] [--gen 128]

(as root add --allow-run-as-root; --oversubscribe for more ranks than cores). Every rank gets
one CPU device of --threads threads and an even share of the layers. Rank 0 measures:

- prompt: tokens/s of a --prompt-token prompt in micro-batches of --ubatch, with the ranks
  overlapping micro-batches (n_copies 4) and taking turns (n_copies 1), best of --reps;
- decode: ms per generated token (one token per call, the logits of each back on rank 0), and
  the same split in one process over virtual devices with the same threads (rank 0 alone, while
  the other ranks wait): the difference is what a token spends in messages and their waits; the
  messages and bytes one token sends are counted by the engine.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import stowlm  # noqa: E402
import stowlm.mpi as mpi  # noqa: E402
from stowlm import _core  # noqa: E402


def prompt_rate(model, ids, ubatch, reps):
    ctx = stowlm.Context(model, n_ctx=len(ids) + 64, n_ubatch=ubatch, n_outputs=1)
    ctx.eval(ids[:ubatch])  # warm up: graphs built, pages touched
    best = None
    for _ in range(reps):
        ctx.clear()
        t0 = time.perf_counter()
        ctx.eval(ids)
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return len(ids) / best, ctx.pipeline


def decode_ms(model, local_model, ids, n_gen):
    """ms per generated token over the ranks and in one process, one token of each in turn (so a
    change in the machine's load hits both alike): medians and the median of the differences."""
    ctxs = [stowlm.Context(m, n_ctx=len(ids) + n_gen + 8, n_ubatch=64, n_outputs=1) for m in (model, local_model)]
    toks = []
    for ctx in ctxs:
        tok = int(np.argmax(ctx.eval(ids)))
        ctx.eval([tok])  # warm up the one-token graph
        toks.append(tok)
    times = [[], []]
    _core.dist.reset_stats()
    for _ in range(n_gen):
        for k, ctx in enumerate(ctxs):
            t0 = time.perf_counter()
            logits = ctx.eval([toks[k]])
            times[k].append(time.perf_counter() - t0)
            toks[k] = int(np.argmax(logits))
    assert toks[0] == toks[1], "the ranks and one process generated different tokens"
    stats = _core.dist.stats()
    diff = np.median(np.array(times[0]) - np.array(times[1]))
    return 1000 * float(np.median(times[0])), 1000 * float(np.median(times[1])), 1000 * float(diff), stats


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--ubatch", type=int, default=256)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    devices, split = mpi.start(a.model, devices=f"cpu:0[threads={a.threads}]",
                               layer_split=None)
    try:
        job = mpi.init()
        rng = np.random.default_rng(0)
        first = stowlm.Model(a.model, devices=devices, layer_split=split, n_copies=4)
        ids = [int(t) for t in rng.integers(1, first.n_vocab, a.prompt)]
        del first
        print(f"model {os.path.basename(a.model)}, {job.size} ranks x {a.threads} thread(s) on "
              f"{len(set(job.hosts))} host(s); layers {split}; prompt {a.prompt} tokens in micro-batches of {a.ubatch}")
        rates = {}
        for nc in (4, 1):
            model = stowlm.Model(a.model, devices=devices, layer_split=split, n_copies=nc)
            rates[nc], mode = prompt_rate(model, ids, a.ubatch, a.reps)
            print(f"  prompt, n_copies {nc}: {rates[nc]:8.1f} tokens/s  (pipeline {mode})")
            del model
        print(f"  overlap / taking turns: {rates[4] / rates[1]:.2f}x")
        local = [f"cpu:{i}[threads={a.threads}]" for i in range(len(devices))]
        one = {}
        for nc in (4, 1):  # the same split in one process (rank 0 alone; the others wait)
            one[nc], mode = prompt_rate(stowlm.Model(a.model, devices=local, layer_split=split, n_copies=nc), ids,
                                        a.ubatch, a.reps)
            print(f"  one process, n_copies {nc}: {one[nc]:8.1f} tokens/s  (pipeline {mode})")
        print(f"  one process, same split: {one[4]:8.1f} tokens/s overlapped, {one[1]:8.1f} taking turns "
              f"({one[4] / one[1]:.2f}x)")
        model = stowlm.Model(a.model, devices=devices, layer_split=split, n_copies=4)
        ms, one_ms, diff, stats = decode_ms(model, stowlm.Model(a.model, devices=local, layer_split=split), ids[:64],
                                            a.gen)
        per = stats["messages"] / a.gen
        print(f"  decode (median of {a.gen} tokens, in turns with one process): {ms:.2f} ms per token over {job.size} "
              f"ranks, {one_ms:.2f} in one process with the same split; in messages: {diff:.2f} ms per token "
              f"(median difference; {per:.0f} messages sent by rank 0 per token, {stats['bytes'] / a.gen / 1024:.1f} "
              "KiB)")
    finally:
        mpi.finish()


if __name__ == "__main__":
    main()
