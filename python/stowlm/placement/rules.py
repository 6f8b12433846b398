"""The rules for calling the core: the defaults every layer of stowlm shares, the checks of the
values a placement is made of, and their translation into what the native planner takes
(tensor overrides as the names they match, shares, copies, interleave, layer order).

Everything above (engine, fit, llm, the CLI) takes these from here, so a default or a check
is written once.
"""
from __future__ import annotations

import functools
import os
import re
from typing import List, Optional, Sequence, Tuple

from .. import _core
from ..devices import DeviceSpec, parse_devices

_native = _core.engine

# ---- defaults ----------------------------------------------------------------------------------
DEFAULT_N_CTX = 4096       # a Context's cells when none is given (capped by the training context)
DEFAULT_N_UBATCH = 512     # tokens per micro-batch
DEFAULT_N_OUTPUTS = 32     # rows of logits per micro-batch an LLM asks for: one to generate, a few for logits()
DEFAULT_N_COPIES = 4       # copies of the tensors that cross devices (pipeline parallelism)
# micro-batches from this many tokens run RAM-resident experts on the GPU (the core's kMoeOffloadMin)
DEFAULT_MOE_OFFLOAD_MIN = int(_native.DEFAULT_MOE_OFFLOAD_MIN)
DEFAULT_KV_TYPE = "f16"
DEFAULT_MAX_CTX = 131072   # fit: the cap on the training context it starts from
DEFAULT_FIT_CTX = 4096     # fit: the floor it reduces the context to before moving weights
CTX_STEP = 256             # fit: the step a context is reduced by, per slot
SLOT_ALIGN = 256           # cells: a slot's region starts on a boundary the attention splits share

# layer: whole layers per device; tensor: every layer cut over the devices, rows gathered (each
# product as on one device); tensor-sum: every layer cut, partial products summed
SPLIT_MODES = ("layer", "tensor", "tensor-sum")
# what Model.shards reports per layer, in the core's order
SHARD_FIELDS = ("q_heads", "kv_heads", "ffn_rows", "experts", "shexp_rows", "expert_rows", "embd_rows")


# ---- checks ------------------------------------------------------------------------------------
def check_split_mode(mode, where: str = "split_mode") -> str:
    if mode not in SPLIT_MODES:
        raise ValueError(f"{where} must be one of {', '.join(map(repr, SPLIT_MODES))}, got {mode!r}")
    return mode


def _n_copies(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n_copies must be a positive integer, got {n!r}")
    return n


def _moe_offload_min(n) -> int:
    if n is None:
        return DEFAULT_MOE_OFFLOAD_MIN
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"moe_offload_min must be an integer >= 0 (0: never), got {n!r}")
    return n


def _interleave(n) -> int:
    """The core's form: 0 asks for its default."""
    if n is None:
        return 0
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"interleave must be a positive integer, got {n!r}")
    return n


def _n_outputs(n_outputs: Optional[int]) -> int:
    """The core's form: 0 asks for n_ubatch rows."""
    if n_outputs is None:
        return 0
    if int(n_outputs) <= 0:
        raise ValueError(f"n_outputs must be positive, got {n_outputs}")
    return int(n_outputs)


def _layer_split(layer_split: Optional[Sequence[int]]) -> List[int]:
    if layer_split is None:
        return []
    split = [int(n) for n in layer_split]
    if any(n < 0 for n in split):
        raise ValueError(f"layer_split {split}: layer counts must be >= 0")
    return split


def _tensor_split(split_mode: str, tensor_split, n_dev: int, layer_split=None, overrides=None,
                  tensor_overrides=None) -> List[float]:
    """The shares the core takes: [] for a layer split; one per device for a tensor split."""
    check_split_mode(split_mode)
    if split_mode == "layer":
        if tensor_split is not None:
            raise ValueError("tensor_split needs split_mode='tensor' or 'tensor-sum'")
        return []
    if layer_split is not None:
        raise ValueError(f"split_mode={split_mode!r} cuts every layer over the devices: give tensor_split, not "
                         "layer_split")
    if overrides or tensor_overrides:
        raise ValueError(f"tensor overrides are not supported with split_mode={split_mode!r} yet")
    shares = [1.0] * n_dev if tensor_split is None else list(tensor_split)
    if len(shares) != n_dev:
        raise ValueError(f"tensor_split has {len(shares)} shares for {n_dev} devices")
    for s in shares:
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not s >= 0 or s != s or s == float("inf"):
            raise ValueError(f"tensor_split: shares must be finite numbers >= 0, got {tensor_split!r}")
    if sum(shares) <= 0:
        raise ValueError("tensor_split: every share is 0")
    return [float(s) for s in shares]


def slot_context(n_ctx: int, n_seq: int) -> int:
    """The context actually made for n_seq slots sharing n_ctx cells: each slot gets n_ctx / n_seq
    cells, rounded down to a multiple of SLOT_ALIGN where that leaves any (so results do not
    depend on the slot; see kv_cache.h)."""
    n_ctx, n_seq = int(n_ctx), int(n_seq)
    if n_seq <= 1:
        return n_ctx
    per = n_ctx // n_seq
    if per >= SLOT_ALIGN:
        per -= per % SLOT_ALIGN
    if per < 1:
        raise ValueError(f"n_ctx {n_ctx} is smaller than n_seq {n_seq}: each sequence needs at least one cell")
    return per * n_seq


def layer_devices(counts: Sequence[int], interleave: Optional[int] = None,
                  cpu_only: bool = True) -> Tuple[List[int], int]:
    """Where each layer goes when device i holds counts[i] layers, and the interleave that is
    (by default 2 only where the devices holding layers are all CPU devices: cpu_only)."""
    devices, v = _native.layer_devices([int(c) for c in counts], _interleave(interleave), cpu_only)
    return list(devices), v


# ---- tensor overrides --------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _file_names(path: str, mtime_ns: int, size: int) -> tuple:
    from ..gguffile import GGUFFile

    with GGUFFile(path) as f:
        return tuple(t.name for t in f.tensors)


def tensor_names(path) -> tuple:
    """The tensor names of a GGUF file (read once per version of the file)."""
    st = os.stat(path)
    return _file_names(os.fspath(path), st.st_mtime_ns, st.st_size)


def _as_names(rx: "re.Pattern", names, whole: bool) -> str:
    """A pattern for the native matcher that matches exactly the names `rx` matches (searched, or
    whole when `whole`): the names themselves, escaped. The matching is Python's; the native
    std::regex then sees no bracket expression, whose locale lookups crash where another library
    loaded first brought its own C++ runtime (jaxlib does), and no pattern that matches nothing
    but "(?!)", so an override that matches no weight is still reported as one."""
    hits = [n for n in names if (rx.fullmatch(n) if whole else rx.search(n))]
    return "(?:" + "|".join(re.escape(n) for n in hits) + ")" if hits else "(?!)"


def _overrides(overrides, devices: List[DeviceSpec], names=None):
    """{regex: device} (or [(regex, device)]) -> [(regex, device index)]; a device is named as in
    the device list ("cpu:1") or given by its index. With the file's tensor `names`, each regex
    becomes the names it matches in whole."""
    if not overrides:
        return []
    items = overrides.items() if hasattr(overrides, "items") else overrides
    dev_names = [d.name for d in devices]
    out = []
    for pattern, dev in items:
        if isinstance(dev, int):
            index = dev
        elif str(dev) in dev_names:
            index = dev_names.index(str(dev))
        else:
            raise ValueError(f"tensor override {pattern!r}: device {dev!r} is not one of {dev_names}")
        if names is None:
            native = str(pattern)
        else:
            try:
                native = _as_names(re.compile(str(pattern)), names, True)
            except re.error as e:
                raise ValueError(f"tensor override {pattern!r}: invalid regular expression: {e}") from None
        out.append((native, int(index), f"{pattern}={dev}"))
    return out


def _tensor_overrides(specs, devices: List[DeviceSpec], names=None):
    """["REGEX=DEVICE", ...] -> [(pattern, device index)]. REGEX is searched for anywhere in a
    tensor's name (as llama.cpp's --override-tensor does); the first matching entry wins. With the
    file's tensor `names`, each becomes the names it matches."""
    if not specs:
        return []
    if isinstance(specs, str):
        specs = [specs]
    dev_names = [d.name for d in devices]
    out = []
    for spec in specs:
        pattern, sep, dev = str(spec).rpartition("=")
        if not sep or not pattern:
            raise ValueError(f"tensor override {spec!r} is not of the form REGEX=DEVICE")
        dev = dev.strip()
        if dev not in dev_names:
            raise ValueError(f"tensor override {spec!r}: device {dev!r} is not one of {dev_names}")
        try:
            rx = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"tensor override {spec!r}: invalid regular expression: {e}") from None
        # The native side matches whole names: the names it matches, or a wrapping that searches.
        native = f".*(?:{pattern}).*" if names is None else _as_names(rx, names, False)
        out.append((native, dev_names.index(dev), str(spec)))
    return out


def _native_overrides(path, tensor_overrides, overrides, devices: List[DeviceSpec]):
    """Both kinds of override for the core, tensor_overrides first, matched against the file's
    tensor names where the file is there to read."""
    names = tensor_names(path) if (tensor_overrides or overrides) and os.path.isfile(path) else None
    return _tensor_overrides(tensor_overrides, devices, names) + _overrides(overrides, devices, names)


# ---- a projection --------------------------------------------------------------------------------
def plan(path, devices=None, layer_split=None, n_ctx: int = DEFAULT_N_CTX, n_ubatch: int = DEFAULT_N_UBATCH,
         kv_type: str = DEFAULT_KV_TYPE, overrides=None, n_outputs: Optional[int] = None,
         tensor_overrides: Optional[Sequence[str]] = None, n_copies: Optional[int] = None,
         split_mode: str = "layer", tensor_split: Optional[Sequence[float]] = None,
         interleave: Optional[int] = None) -> List[dict]:
    """Like Model.plan but without loading (nothing is counted against any budget)."""
    specs = parse_devices(devices)
    shares = _tensor_split(split_mode, tensor_split, len(specs), layer_split, overrides, tensor_overrides)
    return _native.project(os.fspath(path), [d.as_tuple() for d in specs], _layer_split(layer_split),
                           _native_overrides(path, tensor_overrides, overrides, specs), int(n_ctx),
                           int(n_ubatch), kv_type, _n_outputs(n_outputs),
                           _n_copies(DEFAULT_N_COPIES if n_copies is None else n_copies), shares,
                           _interleave(interleave), split_mode == "tensor-sum")["devices"]
