"""Tensor parallelism on this machine's cores: two CPU devices of one thread each with an even
tensor split, against one device with one thread and one device with two, through stowlm-bench
(pp512 and tg128, alternating the configurations each round so drift treats them alike).

    python bench/tp_bench.py [-m MODEL.gguf ...] [--bench build/stowlm-bench] [--rounds 3]

Prints tokens/s per configuration and the ratios the tensor split is held to, and what the
all-reduces move: per generated token 2 x n_layer reductions of an n_embd row of floats per
shard; a mixture-of-experts layer reduces once after its experts' weighted sum (and a shared
expert's part), not once per picked expert, which would be n_expert_used times the traffic.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

CONFIGS = {
    "1 device, 1 thread": ["-dev", "cpu:0[threads=1]"],
    "1 device, 2 threads": ["-dev", "cpu:0[threads=2]"],
    "tensor 1:1, 1+1 threads": ["-dev", "cpu:0[threads=1],cpu:1[threads=1]", "-sm", "tensor", "-ts", "1,1"],
    "layers 1:1, 1+1 threads": ["-dev", "cpu:0[threads=1],cpu:1[threads=1]"],
}


def run(bench, model, args, p, n, reps):
    out = subprocess.run([bench, "-m", model, "-p", str(p), "-n", str(n), "-r", str(reps), "-o", "json"] + args,
                         capture_output=True, text=True, check=True)
    res = json.loads(out.stdout)
    return {("pp" if r["n_prompt"] else "tg"): r["avg_ts"] for r in res}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", action="append")
    ap.add_argument("--bench", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    a = ap.parse_args()
    sys.path.insert(0, HERE)
    from compare import find_stowlm_bench  # this tree's build/ first, then the installed one

    bench = find_stowlm_bench(a.bench)
    from stowlm import _core, pull

    models = a.model or [pull.pull("smollm2-135m", progress=False)]
    with open("/proc/cpuinfo") as f:
        cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "?")
    print(f"CPU: {cpu}, {os.cpu_count()} cores; stowlm-bench -p {a.p} -n {a.n}, {a.rounds} rounds x {a.reps} reps")
    for model in models:
        samples = {c: {"pp": [], "tg": []} for c in CONFIGS}
        for _ in range(a.rounds):
            for name, args in CONFIGS.items():
                for k, v in run(bench, model, args, a.p, a.n, a.reps).items():
                    samples[name][k].append(v)
        med = {c: {k: statistics.median(v) for k, v in s.items()} for c, s in samples.items()}
        print(f"\n{os.path.basename(model)}:")
        for c, m in med.items():
            print(f"  {c:26s} pp{a.p} {m['pp']:8.1f} t/s   tg{a.n} {m['tg']:7.1f} t/s")
        tp, one, two = med["tensor 1:1, 1+1 threads"], med["1 device, 1 thread"], med["1 device, 2 threads"]
        print(f"  tensor split: tg {tp['tg'] / one['tg']:.2f}x one thread (target 1.7), "
              f"{tp['tg'] / two['tg']:.2f}x two threads (target 0.9); pp {tp['pp'] / two['pp']:.2f}x two threads "
              f"(target 0.85)")
        p = _core.engine.Projector(model)
        meta = json.loads(subprocess.run([sys.executable, "-c", f"import stowlm; m = stowlm.Model({model!r}); "
                                          "print(__import__('json').dumps([m.n_embd, m.n_layer]))"],
                                         capture_output=True, text=True, check=True,
                                         env=dict(os.environ, PYTHONPATH=os.path.join(HERE, "..", "python"))).stdout)
        n_embd, n_layer = meta
        row = n_embd * 4
        print(f"  all-reduce: {2 * n_layer} per token, each shard's partial {row} B (an n_embd row of floats); "
              f"with 2 shards each reads the other's: {2 * n_layer * row} B per shard per token")
        if p.n_expert:
            k = p.n_expert_used
            print(f"  experts: one reduction after the weighted sum of the {k} picked experts instead of {k}: "
                  f"{n_layer * row * (k - 1)} B per shard per token saved ({k}x less for the FFN)")


if __name__ == "__main__":
    main()
