"""Low-level inference: a loaded model on one or several devices, and contexts that evaluate
token ids into next-token logits. The graph, scheduling, memory planning and kernels all live
in the native core (stowlm._core.engine); this module only shapes arguments and results."""
from __future__ import annotations

import logging
import os
from typing import List, Optional, Sequence

import numpy as np

from . import _core
from .devices import DeviceSpec, parse_devices
from .placement.costs import check_made_for
from .placement.data import Placement
# the rules for calling the core live with the placements; the names stay importable from here
from .placement.rules import (DEFAULT_KV_TYPE, DEFAULT_N_COPIES, DEFAULT_N_CTX, DEFAULT_N_UBATCH,  # noqa: F401
                              SHARD_FIELDS, _interleave, _layer_split, _moe_offload_min, _n_copies, _n_outputs,
                              _native_overrides,
                              _overrides, _tensor_overrides, _tensor_split, check_split_mode, layer_devices, plan,
                              tensor_names)

_native = _core.engine
_log = logging.getLogger("stowlm")


class Model:
    """A GGUF model mapped (zero copy) and placed on devices.

    layer_split gives the number of layers per device (see interleave); by default the layers
    are spread evenly. overrides ({regex: device}, first match wins) put the weights whose names
    match on another device (e.g. {r"blk\\..*\\.ffn_.*": "cpu:1"}); the nodes that read them run
    there. tensor_overrides (["REGEX=DEVICE", ...], e.g. [r"blk\\.[0-9]+\\.ffn_.*_exps=cpu:1"] for the
    experts of a mixture-of-experts model) do the same with llama.cpp's syntax: the regex is
    searched for in the name; they are tried before `overrides`; one that matches no weight is an
    error. Each device's share of the weights counts against its budget; a device too small
    raises MemoryError naming it, and nothing stays allocated.

    placement (a stowlm.fit Placement or the path of its JSON file) gives all of that at once,
    exactly as fit decided it; a Context over the model then takes its n_ctx, n_ubatch, kv_type
    and n_outputs.

    n_copies (default 4): with the layers on several devices, each device works on a
    micro-batch while the next works on the one before (pipeline parallelism); the tensors that
    cross devices are kept in n_copies copies, one per micro-batch in flight. 1 turns it off.
    interleave (default: 2 when two or more CPU devices, and no GPU, hold layers, each at least
    2): each device's layers in that many chunks, the devices taking turns (device 0 layers 0-6,
    device 1 7-13, device 0 14-21, ...), so a pipeline's stages are shorter and so are its fill
    and drain; on a GPU each extra range costs a sync per generated token, so there it is 1
    unless asked for. 1 keeps one range per device. `layer_devices` says where each layer went.
    moe_offload_min (default 128): with experts kept in RAM (tensor_overrides, fit's spill) and
    the rest of their layers on a GPU, micro-batches of at least this many tokens multiply them on
    the GPU, which copies each layer's experts in as it goes (its compute buffer holds two slots of
    the largest expert tensor); smaller ones (decoding) leave them to the CPU. 0: never.

    split_mode="tensor" (tensor parallelism) cuts every layer over the devices instead, in the
    proportions tensor_split gives (one share per device, default equal; 0 leaves a device out):
    attention by whole KV heads with their query heads, FFNs and every expert by rows, the
    output projections by rows of n_embd, the LM head by vocabulary rows. The devices gather
    each other's rows before and after each output projection (all-gathers), so every product
    is computed as on one device and the logits are one device's bit for bit.
    split_mode="tensor-sum" cuts the output projections by columns instead and adds the
    devices' partial products after each attention and FFN (an all-reduce, always in the same
    order, so results are deterministic): half the meetings and fewer bytes between devices,
    results one device's up to float rounding. `shards` says what each device got."""

    def __init__(self, path, devices=None, layer_split: Optional[Sequence[int]] = None, overrides=None,
                 tensor_overrides: Optional[Sequence[str]] = None, placement=None,
                 n_copies: Optional[int] = None, split_mode: str = "layer", moe_offload_min: Optional[int] = None,
                 tensor_split: Optional[Sequence[float]] = None, interleave: Optional[int] = None):
        path = os.fspath(path)
        if not os.path.exists(path):
            raise ValueError(f"model file {path!r} does not exist")
        self.path = path
        self.placement = None
        if placement is not None:
            given = [k for k, v in (("devices", devices), ("layer_split", layer_split), ("overrides", overrides),
                                    ("tensor_overrides", tensor_overrides)) if v]
            if given:
                raise ValueError(f"Model: a placement fixes {', '.join(given)}; give either the placement or these")
            self.placement = placement = _load_placement(placement, path)
            devices = placement.device_specs
            layer_split = placement.layer_split if placement.split_mode == "layer" else None
            tensor_overrides = placement.tensor_overrides
            if n_copies is not None and n_copies != placement.n_copies:
                raise ValueError(f"Model: n_copies={n_copies} differs from the placement's ({placement.n_copies})")
            n_copies = placement.n_copies
            if moe_offload_min is not None and moe_offload_min != placement.moe_offload_min:
                raise ValueError(f"Model: moe_offload_min={moe_offload_min} differs from the placement's "
                                 f"({placement.moe_offload_min})")
            moe_offload_min = placement.moe_offload_min
            if interleave is not None and interleave != placement.interleave:
                raise ValueError(f"Model: interleave={interleave} differs from the placement's ({placement.interleave})")
            interleave = placement.interleave
            split_mode, tensor_split = placement.split_mode, placement.tensor_split
        self.n_copies = _n_copies(DEFAULT_N_COPIES if n_copies is None else n_copies)
        self.moe_offload_min = _moe_offload_min(moe_offload_min)
        self.devices: List[DeviceSpec] = parse_devices(devices)
        shares = _tensor_split(split_mode, tensor_split, len(self.devices), layer_split, overrides, tensor_overrides)
        self.split_mode = split_mode
        self._m = _native.Model(path, [d.as_tuple() for d in self.devices], _layer_split(layer_split),
                                _native_overrides(path, tensor_overrides, overrides, self.devices), shares,
                                _interleave(interleave), split_mode == "tensor-sum")

    @property
    def shards(self) -> List[dict]:
        """Per shard (tensor parallelism; one shard otherwise): its device index, the vocabulary
        rows of its LM head, and per layer the query heads, KV heads, FFN rows, routed experts it
        computes part of, shared-expert rows, expert rows (over all its experts), and the rows of
        n_embd its output projections give (split_mode="tensor"; 0 with "tensor-sum")."""
        return [{"device": d["device"], "vocab": d["vocab"],
                 "layers": [dict(zip(SHARD_FIELDS, l)) for l in d["layers"]]} for d in self._m.shards]

    arch = property(lambda self: self._m.arch)
    n_layer = property(lambda self: self._m.n_layer)
    n_vocab = property(lambda self: self._m.n_vocab)
    n_expert = property(lambda self: self._m.n_expert)
    # token counts from which some device takes batched kernels (a token's logits are the same
    # in any batch whose size lies between the same two bounds)
    batch_bounds = property(lambda self: list(self._m.batch_bounds))
    n_embd = property(lambda self: self._m.n_embd)
    n_ctx_train = property(lambda self: self._m.n_ctx_train)
    # bytes of weights a generated token reads (an expert stack's used experts only)
    weight_bytes_per_token = property(lambda self: self._m.weight_bytes_per_token)
    layer_devices = property(lambda self: list(self._m.layer_devices))
    interleave = property(lambda self: self._m.interleave)
    # weights the CPU keeps in 16-row groups (csrc/cpu/repack.h; STOWLM_REPACK=0 keeps none)
    repacked = property(lambda self: list(self._m.repacked))

    def attention_macs(self, n_kv: int) -> float:
        """Multiply-adds of one token's attention over n_kv cells, all layers (a sliding window's
        layers see at most its cells)."""
        return self._m.attention_macs(int(n_kv))

    def tensor_device(self, name: str) -> int:
        """Index of the device holding weight `name` (-1 if the model does not use it)."""
        return self._m.tensor_device(name)

    def plan(self, n_ctx: int = DEFAULT_N_CTX, n_ubatch: int = DEFAULT_N_UBATCH, kv_type: str = DEFAULT_KV_TYPE,
             n_outputs: Optional[int] = None, embeddings: bool = False) -> List[dict]:
        """Bytes per device (weights, kv, compute, copies, total, budget) a Context with these
        parameters would take; allocates nothing."""
        return self._m.plan(int(n_ctx), int(n_ubatch), kv_type, _n_outputs(n_outputs), self.n_copies,
                            moe_offload_min=self.moe_offload_min, embeddings=bool(embeddings))["devices"]

    def __repr__(self) -> str:
        return f"Model({self.path!r}, arch={self.arch}, devices={[str(d) for d in self.devices]})"


def _load_placement(placement, path: str) -> Placement:
    """A Placement (or the path of its JSON file), checked to be one made for the model at `path`."""
    if not isinstance(placement, Placement):
        placement = Placement.load(placement)
    check_made_for(placement, path)
    return placement


class Context:
    """KV cache + compute buffers for one sequence over a Model.

    n_ubatch: tokens per micro-batch of prompt processing. n_outputs: most rows of logits one
    micro-batch returns (default n_ubatch); the logits buffer (n_vocab floats per row) dominates
    the compute buffer of large-vocabulary models, so a small n_outputs saves memory and only
    makes logits="all" requests go in smaller steps. embeddings: eval returns each row's final
    hidden state (after the output norm, n_embd floats; what stowlm.embedding pools) instead of
    its logits, and the output head is never run."""

    def __init__(self, model: Model, n_ctx: Optional[int] = None, n_ubatch: Optional[int] = None,
                 kv_type: Optional[str] = None, n_outputs: Optional[int] = None, n_seq: Optional[int] = None,
                 embeddings: bool = False):
        p = model.placement
        if p is not None:  # the placement's values, which its projection was made with
            for key, value in (("n_ctx", n_ctx), ("n_ubatch", n_ubatch), ("kv_type", kv_type), ("n_outputs", n_outputs),
                               ("n_seq", n_seq)):
                if value is not None and value != getattr(p, key):
                    raise ValueError(f"Context: {key}={value!r} differs from the model's placement ({getattr(p, key)!r})")
            n_ctx, n_ubatch, kv_type, n_outputs, n_seq = p.n_ctx, p.n_ubatch, p.kv_type, p.n_outputs, p.n_seq
        if n_ctx is None:
            n_ctx = min(DEFAULT_N_CTX, model.n_ctx_train)
        n_ubatch = DEFAULT_N_UBATCH if n_ubatch is None else n_ubatch
        kv_type = kv_type or DEFAULT_KV_TYPE
        if int(n_ctx) <= 0:
            raise ValueError(f"n_ctx must be positive, got {n_ctx}")
        if int(n_ubatch) <= 0:
            raise ValueError(f"n_ubatch must be positive, got {n_ubatch}")
        n_seq = 1 if n_seq is None else n_seq
        if isinstance(n_seq, bool) or not isinstance(n_seq, int) or not 1 <= n_seq <= int(n_ctx):
            raise ValueError(f"n_seq must be an integer in [1, n_ctx={n_ctx}], got {n_seq!r}")
        self.model = model
        self.n_ubatch = int(n_ubatch)
        self._c = _native.Context(model._m, int(n_ctx), int(n_ubatch), kv_type, _n_outputs(n_outputs), model.n_copies,
                                  n_seq, moe_offload_min=model.moe_offload_min, embeddings=bool(embeddings))
        if self._c.pipeline["n_copies"] == 1 and model.n_copies > 1 and "retried" in self._c.pipeline["reason"]:
            _log.warning("stowlm: pipeline parallelism off: %s", self._c.pipeline["reason"])

    def eval(self, tokens, positions=None, logits: str = "last") -> np.ndarray:
        """Appends tokens to the sequence and returns float32 logits: [n_vocab] for
        logits="last", [len(tokens), n_vocab] for logits="all" (n_embd with embeddings=True)."""
        if logits not in ("last", "all"):
            raise ValueError(f"logits must be 'last' or 'all', got {logits!r}")
        toks = np.asarray(tokens).reshape(-1)
        if toks.size == 0:
            raise ValueError("eval: no tokens")
        if not np.issubdtype(toks.dtype, np.integer):
            raise ValueError(f"eval: tokens must be integers, got {toks.dtype}")
        if self.n_past + toks.size > self.n_ctx:
            raise ValueError(f"eval: {toks.size} tokens (+{self.n_past} already cached) exceed the context "
                             f"n_ctx={self.n_ctx}")
        pos: List[int] = []
        if positions is not None:
            pos = [int(p) for p in np.asarray(positions).reshape(-1)]
            if len(pos) != toks.size:
                raise ValueError(f"eval: {len(pos)} positions for {toks.size} tokens")
        out = self._c.eval(toks.astype(np.int64).tolist(), pos, logits == "all")
        return out if logits == "all" else out[0]

    def eval_batch(self, tokens, seqs, positions=None, rows=None, batched: bool = False) -> np.ndarray:
        """Tokens of several sequences in one pass (token i belongs to sequence seqs[i]; positions
        default to each sequence's next ones). Returns float32 logits [len(rows), n_vocab] of the
        token indices in `rows` (ascending; default the last token). batched: the kernels of a
        prompt-sized pass however few the tokens (can_force_batched says where that is offered),
        so a prompt's tail after a reused prefix gets the bits its whole chunk would."""
        toks = [int(t) for t in tokens]
        if not toks:
            raise ValueError("eval_batch: no tokens")
        rows = [len(toks) - 1] if rows is None else [int(r) for r in rows]
        pos = [] if positions is None else [int(p) for p in positions]
        return self._c.eval_batch(toks, [int(s) for s in seqs], pos, rows, bool(batched))

    can_force_batched = property(lambda self: self._c.can_force_batched)

    def kv_truncate(self, n: int, seq: int = 0) -> None:
        """Keeps the first n tokens of a sequence in the KV cache."""
        self._c.kv_truncate(int(n), int(seq))

    def kv_span(self, seq: int, n: int) -> None:
        """Sequence seq holds the regions of the next n - 1 sequences too (n_ctx / n_seq cells each;
        they must hold nothing), or gives them back (n 1; its tokens must fit its own region): a
        long request in the cells idle slots leave, as llama-server's unified cache."""
        self._c.kv_span(int(seq), int(n))

    def kv_span_of(self, seq: int) -> int:
        return self._c.kv_span_of(int(seq))

    def kv_held_by(self, seq: int) -> Optional[int]:
        """The sequence holding seq's region (kv_span), or None while it is seq's own."""
        h = self._c.kv_held_by(int(seq))
        return None if h < 0 else h

    def capacity(self, seq: int = 0) -> int:
        """Cells sequence seq may hold (its region, and those it holds after it)."""
        return self._c.capacity(int(seq))

    def clear(self, seq: Optional[int] = None) -> None:
        """Empties one sequence, or (None) all of them."""
        self._c.clear(-1 if seq is None else int(seq))

    def n_past_of(self, seq: int) -> int:
        return self._c.n_past_of(int(seq))

    n_past = property(lambda self: self._c.n_past)
    n_ctx = property(lambda self: self._c.n_ctx)
    n_seq = property(lambda self: self._c.n_seq)
    embeddings = property(lambda self: self._c.embeddings)
    row_width = property(lambda self: self._c.row_width)  # floats per row eval returns

    @property
    def pipeline(self) -> dict:
        """{"n_copies": copies of the crossing tensors (1: no pipelining), "reason": why it is off}."""
        return dict(self._c.pipeline)

    @property
    def pipeline_stats(self) -> dict:
        """The last eval that ran as a pipeline: wall_s, busy_s per device, micro_batches."""
        return dict(self._c.pipeline_stats)

    def memory_report(self) -> List[dict]:
        """Per device: weights, kv, compute (incl. copies), total, budget, and the bytes the
        device has actually handed out (allocated)."""
        return self._c.memory_report(self.model._m)
