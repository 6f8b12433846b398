"""A draft model for speculative decoding made from a model: some of its layers, its output matrix
in fewer bits, its vocabulary unchanged.

    python -m stowlm.draftmodel qwen2.5-coder-0.5b draft.gguf --keep 8
    stowlm run qwen2.5-coder-0.5b --spec draft.gguf

A model's own layers, skipped (the first and last kept, the rest evenly), draft the way the model
would write, at a fraction of its cost per token. The output matrix, which every token reads in
full and which dominates small models with large vocabularies, is written as Q4_0 (a tied
embedding stays as it is for the input). No smaller model of the same vocabulary is needed.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

__all__ = ["make_draft", "pick_layers"]

_SKIP_FIELDS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture"}


def pick_layers(n_layer: int, keep: int, edge: int = 2) -> List[int]:
    """keep of n_layer layers: the first and last `edge` (the embedding's and the output's
    neighbours matter most), the others evenly spread between them."""
    if not 1 <= keep <= n_layer:
        raise ValueError(f"keep must be in [1, {n_layer}], got {keep}")
    edge = min(edge, keep // 2)
    inner = keep - 2 * edge
    lo, hi = edge, n_layer - edge  # the middle layers are [lo, hi)
    middle = [lo + round(i * (hi - lo - 1) / max(1, inner - 1)) for i in range(inner)] if inner > 1 else \
        ([lo + (hi - lo) // 2] if inner == 1 else [])
    return sorted(set(list(range(edge)) + middle + list(range(n_layer - edge, n_layer))))


def _value(field):
    import gguf

    t = field.types[0]
    if t == gguf.GGUFValueType.ARRAY:
        if field.types[1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]) for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if t == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]])
    return field.parts[field.data[0]].tolist()[0]


def make_draft(src, dst, keep: Optional[int] = None, layers: Optional[Sequence[int]] = None,
               output_type: str = "Q4_0") -> Path:
    """Writes the draft model of `src` (a .gguf path or model name) to `dst`: the given layers (or
    `keep` of them, pick_layers), the output matrix as output_type ("same" keeps it)."""
    import gguf

    from . import quants
    from .pull import pull

    src = pull(src, progress=False)
    r = gguf.GGUFReader(src)
    arch = bytes(r.fields["general.architecture"].parts[r.fields["general.architecture"].data[0]]).decode()
    n_layer = int(_value(r.fields[f"{arch}.block_count"]))
    if layers is None:
        layers = pick_layers(n_layer, keep if keep is not None else max(1, n_layer // 3))
    layers = sorted(set(int(i) for i in layers))
    if not layers or layers[0] < 0 or layers[-1] >= n_layer:
        raise ValueError(f"layers must be in [0, {n_layer}), got {layers}")
    renumber = {old: new for new, old in enumerate(layers)}
    dst = Path(dst)
    w = gguf.GGUFWriter(os.fspath(dst), arch)
    for name, field in r.fields.items():
        if name in _SKIP_FIELDS or name.startswith("GGUF."):
            continue
        value = _value(field)
        if name == f"{arch}.block_count":
            value = len(layers)
        elif name == "general.name":
            value = (value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)) + \
                f" (draft: layers {','.join(map(str, layers))})"
        elif re.fullmatch(rf"{re.escape(arch)}\..*(_layers|_pattern)", name) and isinstance(value, list) \
                and len(value) == n_layer:  # per-layer lists (e.g. sliding-window patterns) follow the layers
            value = [value[i] for i in layers]
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, value, field.types[0], sub_type=sub)
    tensors = {t.name: t for t in r.tensors}
    replace = output_type != "same"
    for t in r.tensors:
        m = re.match(r"blk\.(\d+)\.(.*)", t.name)
        if m and int(m.group(1)) not in renumber:
            continue
        if replace and t.name == "output.weight":
            continue  # written below in output_type
        _put(w, f"blk.{renumber[int(m.group(1))]}.{m.group(2)}" if m else t.name, t)
    if replace:  # an untied output matrix, or the tied embedding's copy for the output alone
        t = tensors.get("output.weight", tensors["token_embd.weight"])
        shape = [int(x) for x in reversed(t.shape)]  # rows, columns
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            x = np.asarray(t.data, dtype=np.float32).reshape(shape)
        else:
            x = quants.dequantize(np.asarray(t.data).tobytes(), int(t.tensor_type), shape)
        info = quants.type_info(output_type)
        q = quants.quantize(np.ascontiguousarray(x, dtype=np.float32), info.name)
        w.add_tensor("output.weight", q.reshape(shape[0], -1), raw_shape=[shape[0], info.row_bytes(shape[1])],
                     raw_dtype=gguf.GGMLQuantizationType[info.name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _put(w, name, t) -> None:
    import gguf

    shape = [int(x) for x in reversed(t.shape)]
    data = np.asarray(t.data)
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        w.add_tensor(name, data.reshape(shape))
    else:
        w.add_tensor(name, data, raw_shape=list(data.shape), raw_dtype=t.tensor_type)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stowlm.draftmodel", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="the model (.gguf path or name) to draft for")
    ap.add_argument("output", help="where to write the draft .gguf")
    ap.add_argument("--keep", type=int, default=None, help="layers to keep (default a third)")
    ap.add_argument("--layers", default=None, help="the layers to keep, e.g. 0,1,5,9,22,23 (instead of --keep)")
    ap.add_argument("--output-type", default="Q4_0", help="the output matrix's type: Q4_0 (default), Q8_0, same")
    a = ap.parse_args(argv)
    layers = [int(x) for x in a.layers.split(",")] if a.layers else None
    try:
        out = make_draft(a.model, a.output, keep=a.keep, layers=layers, output_type=a.output_type)
    except (ValueError, OSError, KeyError) as e:
        print(f"stowlm.draftmodel: error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
