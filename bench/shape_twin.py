#!/usr/bin/env python3
"""A model's shape twin, for speed only: its GGUF header (metadata, tokenizer, tensor table) kept
byte for byte, its weights random. A GPU machine has no network and a device call carries ~60 MiB,
so a 491 MB model cannot go there; its 6 MB header can, and the twin written from it there gives
stowlm-bench and llama-bench the same tensors, types, shapes and offsets: the same work per token,
the same speed. Its outputs are noise: never judge accuracy with it.

    python3 bench/shape_twin.py save MODEL.gguf OUT.twin     # here: header + tensor table, xz
    python3 bench/shape_twin.py fill IN.twin OUT.gguf        # there: the twin (seconds, numpy only)

The weights: for each block format the quantized values are random bytes and the block's scales
are set so that the dequantized weights have mean ~0 and std ~1/sqrt(fan_in) (activations stay
O(1), logits finite); 1-D F32 tensors are ones where their name says norm, zeros otherwise (biases);
other float tensors are normal with that std. Formats: F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
Q5_K, Q6_K (what shared/models.md's models use); another format is an error naming the tensor.
"""
from __future__ import annotations

import argparse
import json
import lzma
import math
import struct
import sys
from pathlib import Path

import numpy as np

MAGIC = b"STWIN1\n"
# ggml type id -> (name, elements, bytes) of a block
BLOCKS = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
          7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
          14: ("Q6_K", 256, 210)}


def save(model: Path, out: Path) -> dict:
    """Writes model's header and tensor table to out (xz); returns the table."""
    import gguf

    r = gguf.GGUFReader(str(model))
    tensors = []
    for t in r.tensors:
        kind = int(t.tensor_type)
        if kind not in BLOCKS:
            raise SystemExit(f"shape_twin: {model}: tensor {t.name} has type {t.tensor_type.name}, which a twin "
                             f"cannot fill (known: {', '.join(b[0] for b in BLOCKS.values())})")
        tensors.append({"name": t.name, "type": kind, "shape": [int(x) for x in t.shape],
                        "offset": int(t.data_offset), "bytes": int(t.n_bytes)})
    size = model.stat().st_size
    with open(model, "rb") as f:
        header = f.read(int(r.data_offset))
    table = json.dumps({"model": model.name, "bytes": size, "tensors": tensors}).encode()
    with lzma.open(out, "wb", preset=6) as f:
        f.write(MAGIC + struct.pack("<QQ", len(header), len(table)) + header + table)
    return {"bytes": size, "tensors": len(tensors)}


def load(twin: Path):
    with lzma.open(twin, "rb") as f:
        data = f.read()
    if not data.startswith(MAGIC):
        raise SystemExit(f"shape_twin: {twin} is not a twin file (no {MAGIC!r} at its start)")
    n_header, n_table = struct.unpack_from("<QQ", data, len(MAGIC))
    at = len(MAGIC) + 16
    header = data[at:at + n_header]
    table = json.loads(data[at + n_header:at + n_header + n_table])
    return header, table


def _f16(x: float) -> np.ndarray:
    return np.array([x], dtype=np.float16).view(np.uint8)


def blocks(kind: int, n_blocks: int, fan_in: int, rng: np.random.Generator) -> np.ndarray:
    """n_blocks random blocks of format `kind` whose weights have std ~1/sqrt(fan_in)."""
    name, _, size = BLOCKS[kind]
    b = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    std = 1.0 / math.sqrt(max(fan_in, 1))
    uniform = lambda levels: math.sqrt((levels * levels - 1) / 12)  # std of uniform integers over `levels`
    if name in ("Q4_0", "Q5_0", "Q8_0"):  # w = d * (q - centre)
        d = std / uniform({"Q4_0": 16, "Q5_0": 32, "Q8_0": 255}[name])
        if name == "Q8_0":
            b[:, 2:] = np.where(b[:, 2:] == 128, 129, b[:, 2:])  # int8 -128 never occurs in real files
        b[:, 0:2] = _f16(d)
    elif name in ("Q4_1", "Q5_1"):  # w = d * q + m, q in [0, levels)
        levels = 16 if name == "Q4_1" else 32
        d = std / uniform(levels)
        b[:, 0:2], b[:, 2:4] = _f16(d), _f16(-d * (levels - 1) / 2)
    elif name in ("Q4_K", "Q5_K"):  # w = d * sc * q - dmin * m, every 6-bit scale and min 16
        levels = 16 if name == "Q4_K" else 32
        d = std / (16 * uniform(levels))
        b[:, 0:2], b[:, 2:4] = _f16(d), _f16(d * (levels - 1) / 2)
        b[:, 4:16] = np.array([0x50] * 8 + [0] * 4, dtype=np.uint8)  # the 12 packed bytes of 8 x (16, 16)
    elif name == "Q6_K":  # w = d * sc * (q - 32), every int8 scale 16
        b[:, 192:208] = 16
        b[:, 208:210] = _f16(std / (16 * uniform(64)))
    return b


def fill(twin: Path, out: Path, seed: int = 1) -> int:
    """Writes the twin of the model twin was saved from; returns its size in bytes."""
    header, table = load(twin)
    rng = np.random.default_rng(seed)
    tmp = out.with_name(out.name + ".filling")
    with open(tmp, "wb") as f:
        f.write(header)
        for t in sorted(table["tensors"], key=lambda t: t["offset"]):
            if t["offset"] < f.tell():
                raise SystemExit(f"shape_twin: {twin}: tensor {t['name']} overlaps the one before it")
            f.write(b"\0" * (t["offset"] - f.tell()))
            name, per_block, size = BLOCKS[t["type"]]
            n_el = int(np.prod(t["shape"]))
            fan_in = t["shape"][0]
            if name in ("F32", "F16"):
                dt = np.float32 if name == "F32" else np.float16
                if len(t["shape"]) == 1:
                    v = np.ones(n_el, dt) if "norm" in t["name"] else np.zeros(n_el, dt)
                else:
                    v = (rng.standard_normal(n_el, dtype=np.float32) / math.sqrt(fan_in)).astype(dt)
                data = v.tobytes()
            else:
                # a few rows at a time: the big embedding tables stay out of memory
                n_blocks, rows_per = n_el // per_block, max(1, (1 << 22) // size)
                for b0 in range(0, n_blocks, rows_per):
                    f.write(blocks(t["type"], min(rows_per, n_blocks - b0), fan_in, rng).tobytes())
                continue
            if len(data) != t["bytes"]:
                raise SystemExit(f"shape_twin: {twin}: tensor {t['name']} came out {len(data)} bytes, not {t['bytes']}")
            f.write(data)
        f.write(b"\0" * (table["bytes"] - f.tell()))
        size = f.tell()
    if size != table["bytes"]:
        tmp.unlink()
        raise SystemExit(f"shape_twin: {out}: {size} bytes written, the model had {table['bytes']}")
    tmp.replace(out)
    return size


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save", help="a model's header and tensor table into a .twin file")
    s.add_argument("model", type=Path)
    s.add_argument("out", type=Path)
    f = sub.add_parser("fill", help="the twin GGUF from a .twin file")
    f.add_argument("twin", type=Path)
    f.add_argument("out", type=Path)
    f.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    if a.cmd == "save":
        info = save(a.model, a.out)
        print(f"shape_twin: {a.out}: {info['tensors']} tensors of {a.model.name} ({info['bytes'] / 2**20:.1f} MiB), "
              f"{a.out.stat().st_size / 2**20:.2f} MiB")
    else:
        size = fill(a.twin, a.out, a.seed)
        print(f"shape_twin: {a.out}: {size / 2**20:.1f} MiB, random weights (for speed only)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
