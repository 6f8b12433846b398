"""Tensor parallelism on this machine's cores: two CPU devices of one thread each with an even
tensor split (-sm tensor: rows gathered, one device's bits; -sm tensor-sum: partial products
summed), against one device with one thread and one device with two, and a layer split, through
stowlm-bench (pp512 and tg128, alternating the configurations each round so drift treats them
alike).

    python bench/tp_bench.py [-m MODEL.gguf ...] [--bench build/stowlm-bench] [--rounds 3]

Prints tokens/s per configuration, the ratios the tensor split is held to, and what the shards'
meetings move per generated token: -sm tensor gathers, per layer, the heads' attention output,
the output projection's rows, the FFN's activations and the down projection's rows (4
meetings); -sm tensor-sum reduces an n_embd row twice per layer (2 meetings). A mixture-of-
experts layer meets once after its picked experts' weighted sum (and a shared expert's part),
not once per picked expert, which would move n_expert_used times as much.
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
    "tensor-sum 1:1, 1+1 threads": ["-dev", "cpu:0[threads=1],cpu:1[threads=1]", "-sm", "tensor-sum", "-ts", "1,1"],
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
        one, two = med["1 device, 1 thread"], med["1 device, 2 threads"]
        for mode in ("tensor", "tensor-sum"):
            tp = med[f"{mode} 1:1, 1+1 threads"]
            print(f"  {mode}: tg {tp['tg'] / one['tg']:.2f}x one thread (target 1.7), {tp['tg'] / two['tg']:.2f}x two "
                  f"threads (target 0.9); pp {tp['pp'] / two['pp']:.2f}x two threads (target 0.85)")
        traffic(model)


def traffic(model):
    """Bytes each of two shards reads of the other's per generated token, by split mode."""
    from stowlm import gguffile

    f = gguffile.open(model)
    shapes = {t.name: t.shape for t in f.tensors}
    meta = f.metadata
    arch = meta["general.architecture"]
    n_layer, n_embd = meta[f"{arch}.block_count"], meta[f"{arch}.embedding_length"]
    k = meta.get(f"{arch}.expert_used_count", 0)
    gathered = summed = saved_g = saved_s = 0
    for il in range(n_layer):
        w = lambda n: shapes.get(f"blk.{il}.{n}.weight")  # noqa: E731
        act = w("ffn_down")[-1] if w("ffn_down") else 0  # shapes in numpy order: [-1] is ne0
        if w("ffn_down_exps"):
            act = k * w("ffn_down_exps")[-1] + (w("ffn_down_shexp")[-1] if w("ffn_down_shexp") else 0)
            saved_g += (k - 1) * n_embd * 4 // 2
            saved_s += (k - 1) * n_embd * 4
        gathered += (w("attn_output")[-1] + n_embd + act + n_embd) * 4 // 2
        summed += 2 * n_embd * 4
    print(f"  per token and shard, read of the other shard: tensor {gathered} B ({4 * n_layer} gathers), "
          f"tensor-sum {summed} B ({2 * n_layer} all-reduces)")
    if k:
        print(f"  experts: one meeting after the weighted sum of the {k} picked experts instead of {k}: "
              f"{saved_g} B (tensor) / {saved_s} B (tensor-sum) per shard per token saved")


if __name__ == "__main__":
    main()
