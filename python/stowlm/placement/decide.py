"""fit(): the user's settings (or a saved placement's) checked and completed with the defaults,
then the fitter that decides the rest: by layers (layers.py) or by a tensor split (tensor.py).
stowlm.fit is its public face."""
from __future__ import annotations

import os
from typing import Dict, Optional, Sequence, Union

from ..devices import parse_devices
from .budgets import describe_devices
from .costs import check_made_for, fingerprint
from .data import Placement
from .layer_problem import LayerProblem
from .layers import fit_layers
from .rules import (CTX_STEP, DEFAULT_FIT_CTX, DEFAULT_KV_TYPE, DEFAULT_MAX_CTX, DEFAULT_N_COPIES, DEFAULT_N_OUTPUTS,
                    DEFAULT_N_UBATCH, _interleave, _moe_offload_min, _n_copies, _tensor_split, check_split_mode,
                    slot_context)
from .tensor import fit_tensor

# what a saved placement fixes, whoever gives it again
_FIXED = ("n_ctx", "n_copies", "layer_split", "tensor_overrides", "cpu_moe", "n_cpu_moe", "interleave",
          "moe_offload_min")


def fit(model: Union[str, os.PathLike], devices=None, *, n_ctx: Optional[int] = None,
        n_ubatch: Optional[int] = None, n_outputs: Optional[int] = None, kv_type: Optional[str] = None,
        n_copies: Optional[int] = None, n_seq: int = 1, layer_split: Optional[Sequence[int]] = None,
        tensor_overrides: Optional[Sequence[str]] = None, cpu_moe: bool = False, n_cpu_moe: Optional[int] = None,
        margin=None, max_ctx: int = DEFAULT_MAX_CTX, fit_ctx: int = DEFAULT_FIT_CTX,
        placement: Optional[Union[Placement, str, os.PathLike]] = None, split_mode: Optional[str] = "layer",
        tensor_split: Optional[Sequence[float]] = None, interleave: Optional[int] = None,
        reserved: Optional[Dict[str, int]] = None, moe_offload_min: Optional[int] = None) -> Placement:
    """Decide a placement of the GGUF file `model` on `devices` (a list or "cpu:0[...],cuda:0";
    "auto": every CUDA device and the CPU). Every argument given is kept as is; FitError (a
    MemoryError) says which device is short, by how much, and the largest context that fits.
    `placement` starts from a saved placement: all of its values count as set, so fitting a
    fitted placement gives it back. interleave: each device's layers in that many ranges that
    take turns with the other devices' (default 2 where two or more CPU devices and no GPU hold
    layers, and it fits; 1: one range each). split_mode="tensor" or "tensor-sum": every layer cut
    over the devices (the shares are decided unless tensor_split gives them). reserved: device
    name -> bytes a draft model of this process already holds on that CPU device.
    moe_offload_min: as Model's (the GPU's compute buffer then holds the staged experts).
    Allocates nothing."""
    path = os.fspath(model)
    if not os.path.exists(path):
        raise ValueError(f"model file {path!r} does not exist")
    s = dict(devices=devices, n_ctx=n_ctx, n_ubatch=n_ubatch, n_outputs=n_outputs, kv_type=kv_type,
             n_copies=n_copies, n_seq=n_seq, layer_split=layer_split, tensor_overrides=tensor_overrides,
             cpu_moe=cpu_moe, n_cpu_moe=n_cpu_moe, margin=margin, split_mode=split_mode or "layer",
             tensor_split=tensor_split, interleave=interleave, moe_offload_min=moe_offload_min)
    set_by = _set_by_user(s)
    check_split_mode(s["split_mode"])
    if tensor_split is not None and s["split_mode"] == "layer":
        raise ValueError("tensor_split needs split_mode='tensor' or 'tensor-sum'")
    if placement is not None:
        set_by = _take_placement(s, set_by, placement, path)
    specs = parse_devices(s["devices"])
    n_ubatch = DEFAULT_N_UBATCH if s["n_ubatch"] is None else int(s["n_ubatch"])
    if n_ubatch <= 0:
        raise ValueError(f"n_ubatch must be positive, got {n_ubatch}")
    n_ctx = s["n_ctx"]
    if n_ctx is not None and int(n_ctx) <= 0:
        raise ValueError(f"n_ctx must be positive, got {n_ctx}")
    if fit_ctx <= 0 or max_ctx <= 0:
        raise ValueError("fit_ctx and max_ctx must be positive")
    n_outputs = min(DEFAULT_N_OUTPUTS, n_ubatch) if s["n_outputs"] is None else int(s["n_outputs"])
    if not 0 < n_outputs <= n_ubatch:
        raise ValueError(f"n_outputs must be in [1, n_ubatch={n_ubatch}], got {n_outputs}")
    kv_type = s["kv_type"] or DEFAULT_KV_TYPE
    n_copies = _n_copies(DEFAULT_N_COPIES if s["n_copies"] is None else s["n_copies"])
    _interleave(s["interleave"])
    offload_min = _moe_offload_min(s["moe_offload_min"])
    devs, host_free, host_margin = describe_devices(specs, s["margin"], reserved)
    n_seq = s["n_seq"]
    if isinstance(n_seq, bool) or not isinstance(n_seq, int) or n_seq < 1:
        raise ValueError(f"n_seq must be a positive integer, got {n_seq!r}")
    ctx = None if n_ctx is None else slot_context(n_ctx, n_seq)
    if s["split_mode"] != "layer":
        if s["cpu_moe"] or s["n_cpu_moe"] is not None:
            raise ValueError("--cpu-moe / --n-cpu-moe place experts by layers: not with a tensor split")
        shares = _tensor_split(s["split_mode"], s["tensor_split"], len(specs), s["layer_split"], None,
                               s["tensor_overrides"])
        return fit_tensor(path, devs, host_free, host_margin, split_mode=s["split_mode"],
                          shares=None if s["tensor_split"] is None else shares, n_ctx=ctx, n_ubatch=n_ubatch,
                          n_outputs=n_outputs, kv_type=kv_type, n_seq=n_seq, max_ctx=int(max_ctx),
                          fit_ctx=int(fit_ctx), set_by=set_by, fingerprint=fingerprint(path),
                          ctx_step=CTX_STEP * n_seq)
    problem = LayerProblem(path, devs, host_free, host_margin, n_ctx=ctx, n_ubatch=n_ubatch, n_outputs=n_outputs,
                           kv_type=kv_type, n_copies=n_copies, n_seq=n_seq, layer_split=s["layer_split"],
                           user_overrides=s["tensor_overrides"], cpu_moe=s["cpu_moe"], n_cpu_moe=s["n_cpu_moe"],
                           max_ctx=int(max_ctx), fit_ctx=int(fit_ctx), set_by=set_by, interleave=s["interleave"],
                           moe_offload_min=offload_min)
    return fit_layers(problem)


def _set_by_user(s: dict) -> Dict[str, str]:
    """Who set what, for the explanations: every setting given here was set by the user."""
    set_by = {k: "set by the user" for k in ("n_ctx", "n_ubatch", "n_outputs", "kv_type", "n_copies",
                                             "layer_split", "margin", "n_cpu_moe", "interleave", "moe_offload_min")
              if s[k] is not None}
    if s["tensor_overrides"]:
        set_by["tensor_overrides"] = "set by the user"
    if s["cpu_moe"]:
        set_by["cpu_moe"] = "set by the user (--cpu-moe)"
    if s["n_cpu_moe"] is not None:
        set_by["n_cpu_moe"] = f"set by the user (--n-cpu-moe {s['n_cpu_moe']})"
    return set_by


def _take_placement(s: dict, set_by: Dict[str, str], placement, path: str) -> Dict[str, str]:
    """The settings `s` of a saved placement (a Placement or its file), refused where the user
    set any of them too or the placement is another model's; returns who set what."""
    if not isinstance(placement, Placement):
        placement = Placement.load(placement)
    conflict = [k for k in _FIXED if k in set_by]
    if conflict or s["devices"] is not None:
        raise ValueError("fit: a placement fixes the devices, " + ", ".join(conflict or ["devices"]) +
                         "; give either the placement or these")
    check_made_for(placement, path)
    s.update(n_ctx=placement.n_ctx, n_ubatch=placement.n_ubatch, n_outputs=placement.n_outputs,
             kv_type=placement.kv_type, n_seq=placement.n_seq)
    if placement.split_mode != "layer":  # the devices that hold a share, with their shares
        used = placement.used_devices
        s.update(devices=[d.spec for d in used], split_mode=placement.split_mode,
                 tensor_split=placement.tensor_split)
        if s["margin"] is None:
            s["margin"] = [d.margin for d in used]
        return {k: "set by the placement" for k in ("n_ctx", "n_ubatch", "n_outputs", "kv_type", "margin",
                                                    "tensor_split")}
    s.update(devices=[d.spec for d in placement.devices], n_copies=placement.n_copies,
             interleave=placement.interleave, moe_offload_min=placement.moe_offload_min, layer_split=[d.n_layers for d in placement.devices],
             tensor_overrides=list(placement.tensor_overrides))
    if s["margin"] is None:
        s["margin"] = [d.margin for d in placement.devices]
    return {k: "set by the placement" for k in ("n_ctx", "n_ubatch", "n_outputs", "kv_type", "n_copies",
                                                "layer_split", "margin", "tensor_overrides", "interleave",
                                                "moe_offload_min")}
