"""How an LLM gets its model: where it is placed (a placement given, one fitted, or the devices
as given), the model, its tokenizer and chat template, and the context it generates in."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Optional

from . import _core
from .devices import parse_devices
from .engine import Context, Model
from .gguffile import GGUFFile
from .placement.budgets import fits_one_device
from .placement.decide import fit as fit_placement
from .placement.rules import DEFAULT_KV_TYPE, DEFAULT_N_CTX, DEFAULT_N_OUTPUTS, DEFAULT_N_UBATCH, slot_context
from .pull import pull
from .text.chat import ChatTemplate
from .text.tokenizer import Tokenizer


@dataclass
class Loaded:
    path: object
    placement: object
    model: Model
    metadata: dict
    tokenizer: Tokenizer
    template: Optional[ChatTemplate]
    template_error: Optional[str]
    ctx: Context


def load(model, n_ctx=None, devices=None, n_ubatch=None, kv_type=None, layer_split=None, chat_template=None,
         progress=True, tensor_overrides=None, fit=None, placement=None, fit_margin=None, cpu_moe=False,
         n_cpu_moe=None, n_copies=None, fit_ctx=None, n_seq=1, split_mode=None, tensor_split=None,
         interleave=None, reserved=None, moe_offload_min=None, embedding=False) -> Loaded:
    """LLM's arguments (n_threads already made a device) as a loaded model and its context.
    reserved: device name -> bytes a draft model already holds there, which fit counts.
    embedding: the context computes hidden states instead of logits (engine.Context's embeddings)."""
    path = pull(model, progress=progress)
    # held open for the whole load: fit's projector, the native model and the tokenizer then
    # share its one parse and mapping (GGUFFile::open_shared)
    with GGUFFile(path) as f:
        return _load(path, f, n_ctx, devices, n_ubatch, kv_type, layer_split, chat_template, progress,
                     tensor_overrides, fit, placement, fit_margin, cpu_moe, n_cpu_moe, n_copies, fit_ctx, n_seq,
                     split_mode, tensor_split, interleave, reserved, moe_offload_min, embedding)


def _load(path, f, n_ctx, devices, n_ubatch, kv_type, layer_split, chat_template, progress, tensor_overrides, fit,
          placement, fit_margin, cpu_moe, n_cpu_moe, n_copies, fit_ctx, n_seq, split_mode, tensor_split,
          interleave, reserved, moe_offload_min, embedding) -> Loaded:
    if placement is not None:
        given = [k for k, v in (("devices", devices), ("n_ctx", n_ctx), ("n_ubatch", n_ubatch), ("kv_type", kv_type),
                                ("layer_split", layer_split), ("tensor_overrides", tensor_overrides),
                                ("n_cpu_moe", n_cpu_moe), ("n_copies", n_copies), ("split_mode", split_mode),
                                ("tensor_split", tensor_split), ("interleave", interleave),
                                ("moe_offload_min", moe_offload_min)) if v is not None] + \
            (["cpu_moe"] if cpu_moe else [])
        if given:
            raise ValueError(f"LLM: a placement fixes {', '.join(given)}; give either the placement or these")
    elif fit or (fit is None and _wants_fit(path, devices, n_ctx, n_ubatch, kv_type, cpu_moe, n_cpu_moe, n_seq,
                                            fit_margin, reserved, embedding)):
        placement = fit_placement(path, devices, n_ctx=n_ctx, n_ubatch=n_ubatch, kv_type=kv_type,
                                  layer_split=layer_split, tensor_overrides=tensor_overrides,
                                  cpu_moe=cpu_moe, n_cpu_moe=n_cpu_moe, margin=fit_margin, n_copies=n_copies,
                                  n_seq=n_seq, split_mode=split_mode, tensor_split=tensor_split,
                                  interleave=interleave, reserved=reserved, moe_offload_min=moe_offload_min,
                                  **({} if fit_ctx is None else {"fit_ctx": fit_ctx}))
        if progress:
            print(f"[{placement.summary()}]", file=sys.stderr)
    if placement is not None:
        m = Model(path, placement=placement)
        placement = m.placement
    else:
        m = Model(path, devices=devices, layer_split=layer_split, tensor_overrides=tensor_overrides,
                  n_copies=n_copies, split_mode=split_mode or "layer", tensor_split=tensor_split,
                  interleave=interleave, moe_offload_min=moe_offload_min)
    template, template_error = None, None
    meta = f.metadata
    metadata = {k: v for k, v in meta.items() if not k.startswith("tokenizer.ggml.")}
    tokenizer = Tokenizer.from_metadata(meta, name=os.path.basename(path))
    if chat_template is None and not meta.get("tokenizer.chat_template") \
            and str(meta.get("general.architecture", "")).startswith("gemma"):
        chat_template = "gemma"  # gemma GGUFs often ship without one; the family's format is fixed
    try:
        template = ChatTemplate.from_metadata(meta, tokenizer, name=os.path.basename(path), template=chat_template)
    except ValueError as e:
        template_error = str(e)
    if placement is not None:
        # the placement's n_outputs: an embeddings graph is then its logits graph less the head,
        # within the bytes fit projected
        ctx = Context(m, embeddings=embedding)
    else:
        n_ubatch = n_ubatch or DEFAULT_N_UBATCH
        ctx = Context(m, n_ctx=slot_context(_default_ctx(m.n_ctx_train, n_ctx, n_seq), n_seq), n_ubatch=n_ubatch,
                      n_seq=n_seq, kv_type=kv_type, n_outputs=_n_outputs(n_ubatch, embedding), embeddings=embedding)
    return Loaded(path, placement, m, metadata, tokenizer, template, template_error, ctx)


def _default_ctx(n_ctx_train: int, n_ctx: Optional[int], n_seq: int = 1) -> int:
    """n_ctx, or min(DEFAULT_N_CTX, trained) for each of n_seq sequences."""
    return n_seq * min(DEFAULT_N_CTX, n_ctx_train) if n_ctx is None else n_ctx


def _n_outputs(n_ubatch: int, embedding: bool) -> int:
    """Rows a micro-batch returns. Generation needs one row of logits; a few keep logits() reasonably
    batched while the logits buffer (n_vocab floats a row) stays small for 150k-260k vocabularies.
    Embeddings read every row (mean pooling) of n_embd floats: all of them."""
    return n_ubatch if embedding else min(n_ubatch, DEFAULT_N_OUTPUTS)


def _wants_fit(path, devices, n_ctx, n_ubatch, kv_type, cpu_moe, n_cpu_moe, n_seq, margin, reserved=None,
               embedding=False) -> bool:
    """Several devices, an expert spill asked for, or a model that does not fit the one device."""
    specs = parse_devices(devices)
    if len(specs) > 1 or cpu_moe or n_cpu_moe is not None:
        return True
    n_ubatch = n_ubatch or DEFAULT_N_UBATCH
    projector = _core.engine.Projector(os.fspath(path))
    n_ctx = slot_context(_default_ctx(projector.n_ctx_train, n_ctx, n_seq), n_seq)
    return not fits_one_device(projector, specs[0], n_ctx, n_ubatch, kv_type or DEFAULT_KV_TYPE,
                               _n_outputs(n_ubatch, embedding), margin, n_seq, reserved, embedding)
