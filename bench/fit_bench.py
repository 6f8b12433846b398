"""How long fit takes to place a large model over many devices.

Writes a model description: a qwen3moe GGUF with 128 layers (small matrices, so the file is a few
MB; fit's work depends on the layers and devices, not on the bytes), then fits it over 8 devices
of different sizes (7 virtual devices with budgets + the host), letting fit choose the context
(from 131072 down) and spill experts, and prints the time per fit and the projections it made.

    python bench/fit_bench.py [--layers 128] [--devices 8] [--reps 20]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
import stowlm  # noqa: E402
from stowlm.fit import fit  # noqa: E402


def write_description(path, n_layer, n_embd=64, n_head=4, n_head_kv=2, n_expert=8, n_ff=32, vocab=1024):
    import gguf

    arch = "qwen3moe"
    w = gguf.GGUFWriter(path, arch)
    for key, val in [("embedding_length", n_embd), ("block_count", n_layer), ("attention.head_count", n_head),
                     ("attention.head_count_kv", n_head_kv), ("expert_feed_forward_length", n_ff),
                     ("context_length", 131072), ("expert_count", n_expert), ("expert_used_count", 2)]:
        w.add_uint32(f"{arch}.{key}", val)
    hd = n_embd // n_head
    z = lambda *shape: np.zeros(shape, np.float16)  # noqa: E731
    w.add_tensor("token_embd.weight", z(vocab, n_embd))
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("output.weight", z(vocab, n_embd))
    for il in range(n_layer):
        p = f"blk.{il}."
        for name, shape in [("attn_q", (n_head * hd, n_embd)), ("attn_k", (n_head_kv * hd, n_embd)),
                            ("attn_v", (n_head_kv * hd, n_embd)), ("attn_output", (n_embd, n_head * hd)),
                            ("ffn_gate_inp", (n_expert, n_embd)), ("ffn_gate_exps", (n_expert, n_ff, n_embd)),
                            ("ffn_up_exps", (n_expert, n_ff, n_embd)), ("ffn_down_exps", (n_expert, n_embd, n_ff))]:
            w.add_tensor(p + name + ".weight", z(*shape) if name != "ffn_gate_inp" else np.zeros(shape, np.float32))
        for name, n in [("attn_norm", n_embd), ("ffn_norm", n_embd), ("attn_q_norm", hd), ("attn_k_norm", hd)]:
            w.add_tensor(p + name + ".weight", np.ones(n, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=128)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"description-{a.layers}.gguf")
        write_description(path, a.layers)
        size = os.path.getsize(path)
        # Budgets from 3 to 12 MiB: together too small for the 131072 context and every expert.
        devices = [f"cpu:{i + 1}[threads=1,mem={3 + (i * 5) % 10}MiB]" for i in range(a.devices - 1)] + ["cpu:0"]
        times = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            p = fit(path, devices)
            times.append(time.perf_counter() - t0)
        print(p.table())
        print("decisions:\n" + p.explain())
        print(f"\nstowlm {stowlm.__version__}: a {a.layers}-layer qwen3moe description ({size / 2**20:.1f} MiB) over "
              f"{len(devices)} devices: fit median {statistics.median(times) * 1e3:.1f} ms, min "
              f"{min(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms over {a.reps} runs")


if __name__ == "__main__":
    main()
