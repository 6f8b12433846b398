"""A draft model for speculative decoding made from a model: its layers in fewer bits, its output
matrix cut to the tokens that are written most, 5 of its 6 layers.

    python -m stowlm.draftmodel qwen2.5-coder-0.5b draft.gguf --weight-type Q4_0 --vocab 32768
    stowlm run qwen2.5-coder-0.5b --spec draft.gguf

The model's own weights draft the way the model writes: requantized to Q4_0 (--weight-type) they
agree with it on 92-99% of the tokens of code edits. Every draft token reads the output matrix in
full, which dominates small models with large vocabularies; --vocab keeps the first N tokens (BPE
and SentencePiece vocabularies list common pieces first) and the special ones, so the draft
predicts only those, in ids the drafter maps back to the model's (stowlm.draft.token_ids). The
output matrix is written as Q4_0 (--output-type). Skipping layers (--keep, --layers: the first
and last kept, the rest evenly) makes a draft cheaper, and it agrees with the model less
(qwen2.5-coder-0.5b: 20 of 24 layers, 72-95% of the tokens of code edits; 16: about 30%); 5 of 6
(default_keep) drafted code edits fastest.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

__all__ = ["make_draft", "pick_layers", "default_keep", "keep_tokens", "TOKEN_IDS_KEY"]

TOKEN_IDS_KEY = "stowlm.draft.token_ids"  # a trimmed draft's ids in its target's vocabulary
_FLOAT = (0, 1)  # GGML's F32 and F16: written as floats, not requantized
_SKIP_FIELDS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture"}


def default_keep(n_layer: int) -> int:
    """Layers a draft keeps by default: 5 of 6. On two cores a draft of qwen2.5-coder-0.5b with 20
    of its 24 layers (Q4_0, 32768 tokens) agrees with it less (code edits 0.84 of tokens against
    0.91) but costs 0.5 of its step instead of 0.6: code edits 1.25x against 1.17x (open questions
    0.99x against 1.08x; docs/speculative.md)."""
    return max(1, round(n_layer * 5 / 6))


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


def field_value(field):
    """A GGUFReader field's value as GGUFWriter takes it back (strings as bytes)."""
    import gguf

    t = field.types[0]
    if t == gguf.GGUFValueType.ARRAY:
        if field.types[1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]) for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if t == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]])
    return field.parts[field.data[0]].tolist()[0]


def copy_field(w, name: str, field, value=None) -> None:
    """Writes a GGUFReader field to GGUFWriter w with its own type (and arrays' element type):
    its value, or `value` in its place."""
    import gguf

    sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
    w.add_key_value(name, field_value(field) if value is None else value, field.types[0], sub_type=sub)


def make_draft(src, dst, keep: Optional[int] = None, layers: Optional[Sequence[int]] = None,
               output_type: str = "Q4_0", weight_type: str = "same", vocab: Optional[int] = None) -> Path:
    """Writes the draft model of `src` (a .gguf path or model name) to `dst`: the given layers (or
    `keep` of them, pick_layers), the output matrix as output_type, the layers' quantized
    matrices as weight_type ("same" keeps them; a comma list such as "Q3_K,Q4_0": for each matrix
    the first whose blocks fit its rows), and with `vocab` (below the model's count) only
    the first `vocab` tokens and the special ones (keep_tokens)."""
    import gguf

    from . import quants
    from .pull import pull

    src = pull(src, progress=False)
    weight_types = [x.strip() for x in weight_type.split(",") if x.strip()]
    for x in weight_types:  # an unknown type, or one stowlm cannot write, fails before anything is written
        if x != "same" and not quants.type_info(x).quantizable:
            raise ValueError(f"--weight-type {x}: quantizing to {x} is not implemented")
    r = gguf.GGUFReader(src)
    arch = field_value(r.fields["general.architecture"]).decode()
    n_layer = int(field_value(r.fields[f"{arch}.block_count"]))
    if layers is None:
        layers = pick_layers(n_layer, keep if keep is not None else default_keep(n_layer))
    layers = sorted(set(int(i) for i in layers))
    if not layers or layers[0] < 0 or layers[-1] >= n_layer:
        raise ValueError(f"layers must be in [0, {n_layer}), got {layers}")
    renumber = {old: new for new, old in enumerate(layers)}
    rows = None  # the target's token ids the draft keeps, in order (None: all)
    tt = r.fields.get("tokenizer.ggml.token_type")  # absent: every token a normal one
    types = field_value(tt) if tt is not None else [1] * len(r.fields["tokenizer.ggml.tokens"].data)
    if vocab is not None and vocab < len(types):
        rows = keep_tokens(types, vocab)
    dst = Path(dst)
    w = gguf.GGUFWriter(os.fspath(dst), arch)
    for name, field in r.fields.items():
        if name in _SKIP_FIELDS or name.startswith("GGUF."):
            continue
        value = field_value(field)
        if rows is not None and name.startswith("tokenizer.ggml."):
            value = _trim_field(name, value, rows, r.fields["tokenizer.ggml.tokens"])
            if value is None:
                continue
        if name == f"{arch}.vocab_size" and rows is not None:
            value = len(rows)
        elif name == f"{arch}.block_count":
            value = len(layers)
        elif name == "general.name":
            value = (value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)) + \
                f" (draft: layers {','.join(map(str, layers))})"
        elif re.fullmatch(rf"{re.escape(arch)}\..*(_layers|_pattern)", name) and isinstance(value, list) \
                and len(value) == n_layer:  # per-layer lists (e.g. sliding-window patterns) follow the layers
            value = [value[i] for i in layers]
        copy_field(w, name, field, value)
    if rows is not None:  # what the draft's ids are in the target's vocabulary
        w.add_array(TOKEN_IDS_KEY, [int(i) for i in rows])
    tensors = {t.name: t for t in r.tensors}
    replace = output_type != "same"
    for t in r.tensors:
        m = re.match(r"blk\.(\d+)\.(.*)", t.name)
        if m and int(m.group(1)) not in renumber:
            continue
        if replace and t.name == "output.weight":
            continue  # written below in output_type
        name = f"blk.{renumber[int(m.group(1))]}.{m.group(2)}" if m else t.name
        vocab_rows = rows if t.name in ("token_embd.weight", "output.weight") else None
        qtype = _fitting_type(weight_types, int(t.shape[0])) if m and len(t.shape) == 2 and \
            t.tensor_type not in _FLOAT else None
        if qtype is not None:
            _requantize(w, name, t, qtype)
        else:
            put_tensor(w, name, t, vocab_rows)
    if replace:  # an untied output matrix, or the tied embedding's copy for the output alone
        _requantize(w, "output.weight", tensors.get("output.weight", tensors["token_embd.weight"]), output_type,
                    rows)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _fitting_type(weight_types: Sequence[str], row_elems: int) -> Optional[str]:
    """The first of weight_types whose blocks divide a row of row_elems (K-quants need 256), or
    None: the matrix keeps its own type ("same", or no type fits)."""
    from . import quants

    for x in weight_types:
        if x == "same":
            return None
        if row_elems % quants.type_info(x).block_elems == 0:
            return x
    return None


def keep_tokens(token_types: Sequence[int], vocab: int) -> np.ndarray:
    """The token ids a draft of `vocab` tokens keeps: the first ones (BPE and SentencePiece
    vocabularies list common pieces first: the first 32768 of qwen2.5-coder's make 96.5% of its
    answers to bench/spec_bench.py's edits, the first 65536 99%), then every special token (control,
    user-defined, unknown) after them, so the draft can end a turn."""
    types = np.asarray(token_types)
    if vocab < 256:
        raise ValueError(f"vocab must be at least 256 (the byte tokens), got {vocab}")
    special = np.isin(types, (2, 3, 4))  # GGUF token types UNKNOWN, CONTROL, USER_DEFINED
    ids = np.arange(len(types))
    return np.concatenate([ids[:vocab][types[:vocab] != 5], ids[vocab:][special[vocab:]]])  # 5: UNUSED


def _trim_field(name: str, value, rows: np.ndarray, tokens_field):
    """A tokenizer field of the draft that keeps `rows` of the vocabulary (None: leave it out)."""
    if name in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        return [value[i] for i in rows]
    if name.endswith("_token_id"):  # a special token's id, renumbered; dropped with its token
        where = np.flatnonzero(rows == int(value))
        return int(where[0]) if where.size else None
    if name == "tokenizer.ggml.merges":  # those whose parts and result are all kept
        kept = {bytes(tokens_field.parts[tokens_field.data[i]]) for i in rows}
        out = []
        for m in value:
            left, sep, right = m.partition(b" ")
            if sep and left in kept and right in kept and left + right in kept:
                out.append(m)
        return out
    return value


def _requantize(w, name, t, qtype: str, rows: Optional[np.ndarray] = None) -> None:
    """Tensor t written as `name` in type qtype (only its `rows`, where given)."""
    import gguf

    from . import quants

    shape = [int(x) for x in reversed(t.shape)]  # rows, columns
    if t.tensor_type in _FLOAT:
        x = np.asarray(t.data, dtype=np.float32).reshape(shape)
    else:
        x = quants.dequantize(np.asarray(t.data).tobytes(), int(t.tensor_type), shape)
    if rows is not None:
        x, shape = x[rows], [len(rows), shape[1]]
    info = quants.type_info(qtype)
    q = quants.quantize(np.ascontiguousarray(x, dtype=np.float32), info.name)
    w.add_tensor(name, q.reshape(shape[0], -1), raw_shape=[shape[0], info.row_bytes(shape[1])],
                 raw_dtype=gguf.GGMLQuantizationType[info.name])


def put_tensor(w, name, t, rows: Optional[np.ndarray] = None) -> None:
    """Writes a GGUFReader tensor to GGUFWriter w as it is (with `rows`: only those rows)."""
    shape = [int(x) for x in reversed(t.shape)]
    data = np.asarray(t.data)
    if rows is not None:  # a matrix of the vocabulary's rows: GGUF rows are whole blocks, kept as they are
        data, shape = data.reshape(shape[0], -1)[rows], [len(rows), shape[1]]
    if t.tensor_type in _FLOAT:
        w.add_tensor(name, data.reshape(shape))
    else:
        w.add_tensor(name, data, raw_shape=list(data.shape), raw_dtype=t.tensor_type)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stowlm.draftmodel", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="the model (.gguf path or name) to draft for")
    ap.add_argument("output", help="where to write the draft .gguf")
    ap.add_argument("--keep", type=int, default=None,
                    help="layers to keep (default 5 of 6: qwen2.5-coder-0.5b's 20 of 24 drafted code edits fastest)")
    ap.add_argument("--layers", default=None, help="the layers to keep, e.g. 0,1,5,9,22,23 (instead of --keep)")
    ap.add_argument("--output-type", default="Q4_0", help="the output matrix's type: Q4_0 (default), Q8_0, same")
    ap.add_argument("--weight-type", default="Q4_0",
                    help="the layers' quantized matrices' type: Q4_0 (default), Q4_1, Q5_0, Q8_0, Q3_K, same; "
                         "a list such as Q3_K,Q4_0 takes for each matrix the first whose blocks fit its rows "
                         "(K-quants need rows of whole 256-blocks; a matrix no type fits keeps its own)")
    ap.add_argument("--vocab", type=int, default=32768,
                    help="keep the first N tokens (and the special ones), default 32768; 0: all")
    a = ap.parse_args(argv)
    layers = [int(x) for x in a.layers.split(",")] if a.layers else None
    try:
        out = make_draft(a.model, a.output, keep=a.keep, layers=layers, output_type=a.output_type,
                         weight_type=a.weight_type, vocab=a.vocab or None)
    except (ValueError, OSError, KeyError) as e:
        print(f"stowlm.draftmodel: error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
