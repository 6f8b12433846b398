#!/usr/bin/env python3
"""Rewrites a mixture-of-experts GGUF with its expert stacks (ffn_{gate,up,down}_exps) as random
blocks of an i-quant, for SPEED tests only: how the CPU decodes a big MoE whose experts are
IQ1_S .. IQ4_XS (the quants that fit a 235B model in a desktop's RAM). Everything else is copied.

Usage: retype_experts.py IN.gguf OUT.gguf --type IQ2_XXS [--seed 1]
   e.g. python3 ../shared/tools/make_big_moe.py smollm2-135m.gguf /tmp/bigmoe6.gguf --layers 6
        python3 bench/retype_experts.py /tmp/bigmoe6.gguf /tmp/bigmoe6-iq2xxs.gguf --type IQ2_XXS

Blocks are random bytes with the fp16 scale d (each format's first field) set so that weights
stay O(1/sqrt(fan_in)); the outputs are noise.
"""
import argparse

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

from stowlm.draftmodel import copy_field, field_value, put_tensor  # the fields and tensors as they were

# format: rough mean |grid value x sub-block scale| per unit d (sets d for std ~ 1/sqrt(fan_in))
TYPES = {"IQ2_XXS": 12.0, "IQ2_XS": 12.0, "IQ2_S": 12.0, "IQ3_XXS": 40.0, "IQ3_S": 40.0, "IQ1_S": 8.0, "IQ4_XS": 1000.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--type", required=True, choices=sorted(TYPES))
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    qt = T[args.type]
    per, nbytes = gguf.GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(args.seed)
    r = gguf.GGUFReader(args.src)
    w = gguf.GGUFWriter(args.out, field_value(r.fields["general.architecture"]).decode())
    for name, field in r.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            copy_field(w, name, field)
    for t in r.tensors:
        if "_exps." not in t.name:
            put_tensor(w, t.name, t)
            continue
        cols, rows = int(t.shape[0]), int(np.prod(t.shape[1:]))
        if cols % per:
            raise SystemExit(f"{t.name}: {cols} columns are not whole {args.type} blocks")
        data = rng.integers(0, 256, size=(rows, cols // per, nbytes), dtype=np.uint8)
        data[:, :, 0:2] = np.frombuffer(np.float16(1.0 / (TYPES[args.type] * np.sqrt(cols))).tobytes(), np.uint8)
        shape = [int(x) for x in reversed(t.shape)]
        w.add_tensor(t.name, data.reshape(shape[:-1] + [shape[-1] // per * nbytes]), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
