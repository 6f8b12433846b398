"""Fit: decide what goes where, from the core's exact byte projections, before anything loads.

    placement = stowlm.fit.fit("model.gguf", devices=["cuda:0", "cuda:1", "cpu"])
    print(placement.table()); print(placement.explain())
    model = stowlm.Model("model.gguf", placement=placement)

What fit may decide, in this order, and only where the user did not set it:

1. The context. From the model's training context (capped at ``max_ctx``, default 131072) down in
   steps of 256 to ``fit_ctx`` (default 4096), the largest with which every layer, with its KV
   cache, fits on the devices faster than the slowest kind; below that floor nothing is reduced
   and the weights move instead.
2. Dense weights first on the fastest memory: devices are filled in tiers, GPU memory first, then
   CPU devices with a budget (virtual devices), then the host's RAM (a CPU device without one).
   Experts of mixture-of-experts layers spill first, whole layers at a time, to the spill device
   (the last device of the slowest tier, i.e. the host's RAM when it is listed); then whole
   layers. The output head stays on the last device with layers; an untied input embedding goes
   to the spill device (only the prompt's rows of it are read).
3. The layer split inside a tier: contiguous ranges, each device at most what its free memory
   less its margin holds (weights + the KV of its own layers + its own compute buffer, which
   depends on its layers and on whether it holds the output), the stages balanced by speed (a
   CPU device's threads). A device too small for one layer plus its buffers is left out. Then
   each device's layers in `interleave` ranges that take turns (shorter pipeline stages), if
   the exact projection of that fits too.

Free memory: a virtual device's budget; a CUDA device's free memory (``cudaMemGetInfo``, capped by
its ``mem`` budget); for a CPU device without a budget the host's available RAM (MemAvailable).
Weights on a CPU device are read in place from the mapped file: they count in full against that
device and against the host, because every page of them is read for each token. All CPU devices
together must also fit the host's available RAM less its margin.

Margin: what stays free on each device, by default min(1 GiB, the device's memory / 16): 1 GiB
on an 80 GB GPU or a 24 GiB host, 4 MiB on a 64 MiB virtual device.

Every byte count comes from the native planner (the same code that allocates), so a placement
fit accepts allocates exactly what it projects. The search itself works on exact per-layer
weight and KV bytes from the core plus compute-buffer sizes learnt from the projections it
has made, and the answer is always checked by a full projection (a handful per fit).
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

from . import _core
from . import split as splitting
from .devices import DeviceSpec, cuda_devices, parse_bytes, parse_devices
from .engine import DEFAULT_N_COPIES, _interleave, _n_copies, _tensor_overrides, layer_devices, tensor_names
from .placement import DevicePlacement, Placement, check_split_mode, format_size, slot_context

__all__ = ["fit", "FitError", "Placement", "default_margin", "DEFAULT_MAX_CTX", "DEFAULT_FIT_CTX", "CTX_STEP"]

DEFAULT_MAX_CTX = 131072
DEFAULT_FIT_CTX = 4096
CTX_STEP = 256
DEFAULT_N_UBATCH = 512
DEFAULT_N_OUTPUTS = 32  # rows of logits per micro-batch: what LLM asks for (see engine.Context)
MARGIN_MAX = 1 << 30
MARGIN_DIVISOR = 16
_ROUNDS = 64  # projections that may correct a compute-buffer estimate before fit gives up

# An expert tensor of a mixture-of-experts layer (ffn_gate_exps.weight, ffn_down_exps.bias, ...).
EXPERT_NAME = re.compile(r"^blk\.(\d+)\.[a-z0-9_]*_exps\.")
_TIER_NAMES = {0: "GPU memory", 1: "CPU devices with a budget", 2: "the host's RAM"}


class FitError(MemoryError):
    """The model does not fit with the values the user set. ``shortfalls`` maps each device that
    is short to the bytes it lacks; ``largest_ctx`` is the largest context that fits with the
    other settings as given (None when none does)."""

    def __init__(self, message: str, shortfalls: Optional[Dict[str, int]] = None,
                 largest_ctx: Optional[int] = None):
        super().__init__(message)
        self.shortfalls = dict(shortfalls or {})
        self.largest_ctx = largest_ctx


def largest_fitting(steps: Sequence[int], probe) -> Optional[Tuple[int, object]]:
    """(step, probe(step)) for the largest of the ascending `steps` whose probe is not None (the
    probe fails above some step and succeeds below it), by bisection; None when none succeeds."""
    best, a, b = None, 0, len(steps) - 1
    while a <= b:
        mid = (a + b) // 2
        got = probe(steps[mid])
        if got is not None:
            best, a = (steps[mid], got), mid + 1
        else:
            b = mid - 1
    return best


def default_margin(total: int) -> int:
    """What fit leaves free on a device of `total` bytes unless told otherwise."""
    return min(MARGIN_MAX, total // MARGIN_DIVISOR)


def host_available_bytes() -> int:
    """The host's available RAM (MemAvailable: free plus what the kernel can reclaim)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return physical_ram_bytes()


def physical_ram_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# ---- devices as fit sees them ---------------------------------------------------------------------

@dataclass
class _Dev:
    index: int       # in the user's device list
    spec: DeviceSpec
    total: int       # the memory it has (budget, GPU memory, host RAM)
    free: int
    margin: int
    speed: float     # relative: the spec's speed=, else a CPU device's threads, 1 for a GPU
    tier: int        # 0 GPU memory, 1 a CPU device with a budget, 2 the host's RAM
    free_source: str

    name = property(lambda self: self.spec.name)
    cpu = property(lambda self: self.spec.kind == "cpu")
    room = property(lambda self: self.free - self.margin)


def _margins(margin, n: int) -> List[Optional[int]]:
    """None / bytes / "512MiB" / a list of those (one per device) -> bytes per device (None: default)."""
    if margin is None:
        return [None] * n
    if isinstance(margin, str) and "," in margin:
        margin = [m for m in margin.split(",")]
    items = list(margin) if isinstance(margin, (list, tuple)) else [margin] * n
    if len(items) != n:
        raise ValueError(f"margin: {len(items)} values for {n} devices (give one, or one per device)")
    out: List[Optional[int]] = []
    for m in items:
        value = parse_bytes(m) if isinstance(m, str) else int(m)
        if value < 0:
            raise ValueError(f"margin must be >= 0, got {m!r}")
        out.append(value)
    return out


def _describe_devices(specs: List[DeviceSpec], margin) -> Tuple[List[_Dev], int, int]:
    """Free memory, margin, speed and tier of each device; and the host's available RAM and margin."""
    margins = _margins(margin, len(specs))
    host_total, host_free = physical_ram_bytes(), host_available_bytes()
    host_margin = default_margin(host_total)
    default_threads = _core.engine.default_threads()
    out = []
    for i, (s, m) in enumerate(zip(specs, margins)):
        if s.kind == "cpu":
            if s.mem_bytes:
                total = free = s.mem_bytes
                source, tier = "its budget", 1
            else:
                total, free = host_total, host_free
                source, tier = "the host's available RAM", 2
                if m is not None:
                    host_margin = m
            speed = float(s.threads or default_threads)
        else:
            found = {d["index"]: d for d in cuda_devices()[0]}
            d = found[s.index]
            total = min(s.mem_bytes, d["total_bytes"]) if s.mem_bytes else d["total_bytes"]
            free = min(total, d["free_bytes"])
            source, tier, speed = "cudaMemGetInfo" + (", capped by its budget" if s.mem_bytes else ""), 0, 1.0
        speed = s.speed or speed  # as the spec states it, where it does
        m = default_margin(total) if m is None else m
        if m >= free:
            raise ValueError(f"margin {format_size(m)} for {s.name} is not smaller than its free memory "
                             f"({format_size(free)}, {source})")
        out.append(_Dev(i, s, total, free, m, speed, tier, source))
    return out, host_free, host_margin


# ---- what each piece of the model costs -------------------------------------------------------------

class _Costs:
    """Bytes of every piece of the model, from the core's own accounting: per layer its dense
    weights, its expert weights and its KV cache; the input embedding (with the first device
    unless moved) and the output head (with the last); weights the user's overrides pin to a
    device. Sizes are kept for both kinds of device: CPU (read in place) and GPU (packed)."""

    def __init__(self, projector, native_overrides, override_devices: List[int], kv_type: str):
        self.projector = projector
        self.kv_type = kv_type
        n = self.n_layer = projector.n_layer
        self.dense = {True: [0] * n, False: [0] * n}
        self.expert = {True: [0] * n, False: [0] * n}
        self.first = {True: 0, False: 0}
        self.last = {True: 0, False: 0}
        self.pinned: Dict[int, Dict[bool, int]] = {}
        self.first_names: List[str] = []
        self.pinned_experts: Dict[int, set] = {}  # layer -> devices its expert tensors are pinned to
        moe = set()
        rows = projector.weights(native_overrides)
        # Work of a layer for one token: its weights' elements, an expert stack's in the share
        # of experts a token uses (what a stage's time is balanced on).
        used = projector.n_expert_used / projector.n_expert if projector.n_expert else 1.0
        work = [0.0] * n
        for name, anchor, nbytes, packed, hit, elements in rows:
            if anchor >= 0:
                work[anchor] += elements * (used if EXPERT_NAME.match(name) else 1.0)
            size = {True: nbytes, False: packed}
            if hit >= 0:
                m = EXPERT_NAME.match(name)
                if m:
                    self.pinned_experts.setdefault(int(m.group(1)), set()).add(override_devices[hit])
                pin = self.pinned.setdefault(override_devices[hit], {True: 0, False: 0})
                for k in size:
                    pin[k] += size[k]
                continue
            if anchor >= 0:
                m = EXPERT_NAME.match(name)
                part = self.expert if m else self.dense
                if m:
                    moe.add(anchor)
                for k in size:
                    part[k][anchor] += size[k]
            else:
                part = self.first if anchor == -1 else self.last
                if anchor == -1:
                    self.first_names.append(name)
                for k in size:
                    part[k] += size[k]
        self.moe_layers = sorted(moe)
        self.fingerprint = hashlib.sha256(
            (projector.arch + "|" + ";".join(f"{r[0]}:{r[2]}" for r in sorted(rows))).encode()).hexdigest()[:16]
        self._dense_sum = {k: _prefix(v) for k, v in self.dense.items()}
        self._expert_sum = {k: _prefix(v) for k, v in self.expert.items()}
        self._moe_count = _prefix([1 if l in moe else 0 for l in range(n)])
        self.work_sum = _prefix(work)
        self._kv: Dict[int, List[int]] = {}
        self._spill: Dict[Tuple[int, ...], tuple] = {}

    def spilled(self, spill: Tuple[int, ...]) -> tuple:
        """Prefix sums over the layers of a spill set: expert bytes (CPU, GPU) and layer count."""
        if spill not in self._spill:
            s = set(spill)
            self._spill[spill] = ({k: _prefix([v[l] if l in s else 0 for l in range(self.n_layer)])
                                   for k, v in self.expert.items()},
                                  _prefix([1 if l in s else 0 for l in range(self.n_layer)]))
        return self._spill[spill]

    def kv_sum(self, ctx: int) -> List[int]:
        """Prefix sums of the KV bytes of the layers at this context."""
        if ctx not in self._kv:
            self._kv[ctx] = _prefix(self.projector.kv_layer_bytes(ctx, self.kv_type))
        return self._kv[ctx]

    def layers_bytes(self, cpu: bool, start: int, end: int) -> int:
        return (self._dense_sum[cpu][end] - self._dense_sum[cpu][start] + self._expert_sum[cpu][end] -
                self._expert_sum[cpu][start])

    def n_moe(self, start: int, end: int) -> int:
        return self._moe_count[end] - self._moe_count[start]


def _prefix(values: Sequence[int]) -> List[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


# ---- layouts --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Layout:
    order: Tuple[int, ...]    # devices (user indices) in pipeline order
    counts: Tuple[int, ...]   # layers per device of `order`
    spill: Tuple[int, ...]    # layers whose experts go to the spill device
    embd_to_spill: bool       # the untied input embedding goes to the spill device

    def count(self, d: int) -> int:
        return self.counts[self.order.index(d)]

    def range_of(self, d: int) -> Tuple[int, int]:
        i = self.order.index(d)
        start = sum(self.counts[:i])
        return start, start + self.counts[i]

    def last_device(self) -> Optional[int]:
        for d, c in zip(reversed(self.order), reversed(self.counts)):
            if c:
                return d
        return None


class _Fitter:
    def __init__(self, path: str, devs: List[_Dev], host_free: int, host_margin: int, *, n_ctx, n_ubatch,
                 n_outputs, kv_type, n_copies, n_seq, layer_split, user_overrides, cpu_moe, n_cpu_moe, max_ctx, fit_ctx,
                 set_by: Dict[str, str], interleave: Optional[int] = None):
        self.path, self.devs = path, devs
        self.host_free, self.host_margin = host_free, host_margin
        self.n_ubatch, self.n_outputs, self.kv_type, self.n_seq = n_ubatch, n_outputs, kv_type, n_seq
        # Searched with one copy unless the user set it (see _with_copies).
        self.wanted_copies = n_copies
        self.n_copies = n_copies if "n_copies" in set_by else 1
        self.n_ctx, self.max_ctx, self.fit_ctx = n_ctx, max_ctx, fit_ctx
        self.set_by = set_by
        # Searched with contiguous ranges, then interleaved if that fits too (see _with_interleave).
        self.wanted_interleave, self.interleave, self.interleave_reason = interleave, 1, ""
        self.projector = _core.engine.Projector(path)
        self.L = self.projector.n_layer
        specs = [d.spec for d in devs]
        self.user_overrides = list(user_overrides or [])
        self.names = tensor_names(path)  # the file's: overrides reach the core as the names they match
        native = _tensor_overrides(self.user_overrides, specs, self.names)
        self.costs = _Costs(self.projector, native, [o[1] for o in native], kv_type)
        self.native_user_overrides = native
        self.tied = self.projector.tied_output
        if layer_split is not None:
            if len(layer_split) != len(devs) or sum(layer_split) != self.L or any(c < 0 for c in layer_split):
                raise ValueError(f"layer_split {list(layer_split)} must give {len(devs)} counts >= 0 that sum to "
                                 f"the model's {self.L} layers")
        self.layer_split = None if layer_split is None else tuple(int(c) for c in layer_split)

        # Tiers (fastest first) and the spill device: the last device of the slowest tier.
        kinds = sorted({d.tier for d in devs})
        self.tiers = [[d.index for d in devs if d.tier == t] for t in kinds]
        cpu_last = [d.index for d in devs if d.cpu]
        self.spill_dev: Optional[int] = self.tiers[-1][-1] if len(self.tiers) > 1 and devs[self.tiers[-1][-1]].cpu \
            else None
        moe = self.costs.moe_layers
        self.user_spill: Optional[Tuple[int, ...]] = None
        if cpu_moe or n_cpu_moe is not None:
            if not moe:
                raise ValueError(f"{'--cpu-moe' if cpu_moe else '--n-cpu-moe'}: {os.path.basename(path)} has no "
                                 "expert tensors (it is not a mixture-of-experts model)")
            if not cpu_last:
                raise ValueError("--cpu-moe / --n-cpu-moe put experts on a CPU device, and the device list has none")
            if self.spill_dev is None:
                self.spill_dev = cpu_last[-1]
            if n_cpu_moe is not None and not 0 <= n_cpu_moe <= self.L:
                raise ValueError(f"--n-cpu-moe {n_cpu_moe} must be in [0, {self.L}]")
            self.user_spill = tuple(moe) if cpu_moe else tuple(l for l in moe if l < n_cpu_moe)
        self.embd_to_spill = (self.spill_dev is not None and len(self.tiers) > 1 and not self.tied and
                              bool(self.costs.first_names))
        self.observed: Dict[tuple, int] = {}
        self.projections = 0

    # -- the cost of one device ---------------------------------------------------------------------
    def _role(self, ctx: int, d: int, start: int, end: int, holds_output: bool, spill: Tuple[int, ...],
              hosts_spill: bool):
        """What a device's compute buffer depends on: the micro-batch (n_ubatch, at most n_ctx),
        the kinds of its layers, whether it holds the output head or spilled experts, and whether
        the micro-batches are likely pipelined (copy slots; spilled or pinned weights stop it)."""
        n_moe = self.costs.n_moe(start, end)
        count = self.costs.spilled(spill)[1]
        n_spilled = count[end] - count[start]
        kinds = frozenset(k for k, n in (("dense", end - start - n_moe), ("moe", n_moe - n_spilled),
                                         ("moe-spilled", n_spilled)) if n > 0)
        pipelined = self.n_copies > 1 and len(self.devs) > 1
        return d, min(self.n_ubatch, ctx), holds_output, kinds, hosts_spill, pipelined

    def _compute_estimate(self, role) -> int:
        """A device's compute buffer in a role (its layers' kinds, whether it holds the output or
        spilled experts): the largest seen in a projection, 0 before one is seen. Never guessing
        high means fit never refuses a layout it has not projected; a low guess is caught by the
        projection of the layout chosen, which teaches the real size."""
        return self.observed.get(role, 0)

    def _weights(self, d: int, start: int, end: int, holds_output: bool, spill: Tuple[int, ...],
                 embd_to_spill: bool) -> int:
        c, cpu = self.costs, self.devs[d].cpu
        spilled = c.spilled(spill)[0][cpu]
        w = c.layers_bytes(cpu, start, end) - (spilled[end] - spilled[start])
        w += c.pinned.get(d, {True: 0, False: 0})[cpu]
        if holds_output:
            w += c.last[cpu]
        if start == 0 and end > 0 and not embd_to_spill:
            w += c.first[cpu]
        if d == self.spill_dev:
            w += spilled[-1]
            if embd_to_spill:
                w += c.first[cpu]
        return w

    def _kv(self, ctx: int, start: int, end: int) -> int:
        kv = self.costs.kv_sum(ctx)
        return kv[end] - kv[start]

    def _total(self, ctx, d, start, end, holds_output, spill, embd_to_spill) -> int:
        hosts = d == self.spill_dev and (bool(spill) or embd_to_spill)
        role = self._role(ctx, d, start, end, holds_output, spill, hosts)
        return (self._weights(d, start, end, holds_output, spill, embd_to_spill) + self._kv(ctx, start, end) +
                self._compute_estimate(role))

    def _analytic(self, layout: _Layout, ctx: int) -> Dict[int, int]:
        last = layout.last_device()
        out = {}
        for d in layout.order:
            start, end = layout.range_of(d)
            out[d] = self._total(ctx, d, start, end, d == last, layout.spill, layout.embd_to_spill)
        return out

    def _fits(self, layout: _Layout, ctx: int) -> bool:
        totals = self._analytic(layout, ctx)
        if any(t > self.devs[d].room for d, t in totals.items()):
            return False
        return sum(t for d, t in totals.items() if self.devs[d].cpu) <= self.host_free - self.host_margin

    # -- cutting layers over a group of devices -------------------------------------------------
    def _fill(self, group: List[int], ctx: int, start_min: int, end: int, output_open: bool,
              spill: Tuple[int, ...]) -> Tuple[List[int], int]:
        def fits(i, start, stop, holds_output):
            d = group[i]
            return self._total(ctx, d, start, stop, holds_output, spill, self.embd_to_spill) <= self.devs[d].room

        return splitting.balanced([self.devs[d].speed for d in group], start_min, end, fits, output_open,
                                  self.costs.work_sum)

    def _pipeline_order(self) -> Tuple[int, ...]:
        if self.layer_split is not None:
            return tuple(range(len(self.devs)))
        return tuple(d for tier in reversed(self.tiers) for d in tier)

    def _layout(self, counts: Dict[int, int], spill: Tuple[int, ...]) -> _Layout:
        order = self._pipeline_order()
        return _Layout(order, tuple(counts.get(d, 0) for d in order), tuple(spill), self.embd_to_spill)

    def _fill_fast(self, ctx: int, h: int, spill: Tuple[int, ...]) -> Tuple[Dict[int, int], int]:
        """Layers [h, L) over the faster tiers, the fastest taking the last layers and the most."""
        counts: Dict[int, int] = {}
        end, output_open = self.L, True
        for tier in self.tiers[:-1]:
            c, start = self._fill(tier, ctx, h, end, output_open, spill)
            counts.update(zip(tier, c))
            output_open = output_open and start == end
            end = start
        return counts, end

    def _tiered(self, ctx: int, h: int, spill: Tuple[int, ...]) -> Optional[_Layout]:
        counts, reached = self._fill_fast(ctx, h, spill)
        if reached > h:
            return None
        slow = self.tiers[-1]
        c, start = self._fill(slow, ctx, 0, h, h == self.L, spill)
        if start > 0:
            return None
        counts.update(zip(slow, c))
        layout = self._layout(counts, spill)
        return layout if self._fits(layout, ctx) else None

    def _min_spill(self, candidates: List[int], works) -> Optional[Tuple[int, ...]]:
        """The fewest of `candidates` (a prefix) whose experts spill for `works` to accept."""
        lo, hi = 0, len(candidates)
        if works(tuple(candidates)) is None:
            return None
        while lo < hi:
            mid = (lo + hi) // 2
            if works(tuple(candidates[:mid])) is not None:
                hi = mid
            else:
                lo = mid + 1
        return tuple(candidates[:lo])

    def _search(self, ctx: int, ideal: bool) -> Optional[_Layout]:
        """The preferred layout at this context, from the current estimates; None if none fits.
        ideal: nothing moves to the slowest tier (no experts spilled, no layers there)."""
        moe, user_spill = self.costs.moe_layers, self.user_spill
        if self.layer_split is not None:
            counts = dict(zip(range(len(self.devs)), self.layer_split))
            check = lambda spill: (lambda lay: lay if self._fits(lay, ctx) else None)(self._layout(counts, spill))  # noqa: E731
            if user_spill is not None or self.spill_dev is None or not moe or ideal:
                return check(user_spill or ())
            start, end = self._layout(counts, ()).range_of(self.spill_dev)
            spill = self._min_spill([l for l in moe if not start <= l < end], check)
            return None if spill is None else check(spill)
        if len(self.tiers) == 1:
            spill = user_spill or ()
            counts, start = self._fill(self.tiers[0], ctx, 0, self.L, True, spill)
            if start > 0:
                return None
            layout = self._layout(dict(zip(self.tiers[0], counts)), spill)
            return layout if self._fits(layout, ctx) else None
        if ideal:
            return self._tiered(ctx, 0, user_spill or ())
        # The fewest whole layers on the slowest tier, with every expert of the rest spilled ...
        spill_for = (lambda h: user_spill) if user_spill is not None else \
            (lambda h: tuple(l for l in moe if l >= h))
        lo, hi = 0, self.L
        while lo < hi:
            mid = (lo + hi) // 2
            if self._fill_fast(ctx, mid, spill_for(mid))[1] <= mid:
                hi = mid
            else:
                lo = mid + 1
        for h in range(lo, self.L + 1):
            if self._tiered(ctx, h, spill_for(h)) is None:
                continue
            if user_spill is not None or not moe:
                return self._tiered(ctx, h, spill_for(h))
            # ... then the fewest experts spilled.
            spill = self._min_spill([l for l in moe if l >= h], lambda s: self._tiered(ctx, h, s))
            return self._tiered(ctx, h, spill)
        return None

    # -- exact projections ----------------------------------------------------------------------
    def _used(self, layout: _Layout) -> List[int]:
        hosts = set(self.costs.pinned)
        if self.spill_dev is not None and (layout.spill or layout.embd_to_spill):
            hosts.add(self.spill_dev)
        return [d for d, c in zip(layout.order, layout.counts) if c or d in hosts]

    def _overrides(self, layout: _Layout) -> List[Tuple[str, str]]:
        """(REGEX, device name) in the order they apply: the user's, then fit's."""
        out = [(spec.rpartition("=")[0], spec.rpartition("=")[2].strip()) for spec in self.user_overrides]
        if self.spill_dev is not None:
            host = self.devs[self.spill_dev].name
            if layout.spill:
                out.append((r"^blk\.(?:" + "|".join(str(l) for l in layout.spill) + r")\.[a-z0-9_]*_exps\.", host))
            if layout.embd_to_spill:
                out += [("^" + re.escape(n) + "$", host) for n in self.costs.first_names]
        return out

    def _project(self, layout: _Layout, ctx: int, interleave: int = 1) -> Dict[int, dict]:
        used = self._used(layout)
        specs = [self.devs[d].spec for d in used]
        overrides = _tensor_overrides([f"{p}={dev}" for p, dev in self._overrides(layout)], specs, self.names)
        result = self.projector.project([s.as_tuple() for s in specs], [layout.count(d) for d in used], overrides,
                                        ctx, self.n_ubatch, self.kv_type, self.n_outputs, self.n_copies, self.n_seq,
                                        interleave=interleave)
        self.projections += 1
        self.pipeline = dict(result["pipeline"])
        out = {d: dict(r) for d, r in zip(used, result["devices"])}
        if interleave > 1:  # the accounting below is of contiguous ranges
            return out
        last = layout.last_device()
        for d in used:  # what the search will expect of this device's role from now on
            start, end = layout.range_of(d)
            hosts = d == self.spill_dev and (bool(layout.spill) or layout.embd_to_spill)
            role = self._role(ctx, d, start, end, d == last, layout.spill, hosts)
            self.observed[role] = max(self.observed.get(role, 0), out[d]["compute"])
            expect_w = self._weights(d, start, end, d == last, layout.spill, layout.embd_to_spill)
            if (expect_w, self._kv(ctx, start, end)) != (out[d]["weights"], out[d]["kv"]):
                raise RuntimeError(f"fit: its accounting of {self.devs[d].name} (weights {expect_w}, KV "
                                   f"{self._kv(ctx, start, end)}) differs from the core's ({out[d]['weights']}, "
                                   f"{out[d]['kv']}); please report this")
        return out

    def _over(self, proj: Dict[int, dict]) -> Dict[str, int]:
        """Device name -> bytes over its room, for every device (and the host) short."""
        short = {self.devs[d].name: r["total"] - self.devs[d].room for d, r in proj.items()
                 if r["total"] > self.devs[d].room}
        host = sum(r["total"] for d, r in proj.items() if self.devs[d].cpu) - (self.host_free - self.host_margin)
        if host > 0 and not short:
            short["host RAM"] = host
        return short

    # -- the decision -------------------------------------------------------------------------------
    def _context_range(self) -> Tuple[int, int]:
        hi = max(1, min(self.projector.n_ctx_train, self.max_ctx))
        lo = min(self.fit_ctx, hi)
        return slot_context(max(lo, self.n_seq), self.n_seq), slot_context(max(hi, self.n_seq), self.n_seq)

    def _ctx_step(self) -> int:
        return CTX_STEP * self.n_seq  # every slot's share moves by CTX_STEP

    def _choose(self) -> Tuple[int, Optional[_Layout], bool]:
        """(context, layout, whether it is the ideal layout) from the current estimates."""
        if self.n_ctx is not None:
            return self.n_ctx, self._search(self.n_ctx, False), False
        lo, hi = self._context_range()
        layout = self._search(hi, True)
        if layout is not None:
            return hi, layout, True
        steps = [c for c in range(lo, hi, self._ctx_step())]  # lo, lo+256, ... below hi
        if steps and steps[0] != lo:
            steps.insert(0, lo)
        best = largest_fitting(steps, lambda c: self._search(c, True))
        if best is not None:
            return best[0], best[1], True
        return lo, self._search(lo, False), False

    def solve(self) -> Placement:
        for _ in range(_ROUNDS):
            ctx, layout, ideal = self._choose()
            if layout is None:
                raise self._fit_error(ctx)
            proj = self._project(layout, ctx)
            if not self._over(proj):
                proj = self._with_copies(layout, ctx, proj)
                return self._placement(layout, ctx, self._with_interleave(layout, ctx, proj))
        raise RuntimeError(f"fit: no placement settled after {_ROUNDS} projections; please report this")

    def _with_copies(self, layout: _Layout, ctx: int, proj: Dict[int, dict]) -> Dict[int, dict]:
        """Pipelining's copies never displace weights or context: unless the user set n_copies,
        the layout is chosen with one copy, then takes the default copies if they fit too."""
        if "n_copies" in self.set_by or self.wanted_copies == 1:
            return proj
        self.n_copies = self.wanted_copies
        more = self._project(layout, ctx)
        if not self._over(more):
            return more
        short = ", ".join(f"{name} by {format_size(b)}" for name, b in self._over(more).items())
        self.n_copies = 1
        proj = self._project(layout, ctx)
        self.pipeline["reason"] = (f"its {self.wanted_copies} copies of the tensors that cross devices did not fit "
                                   f"with this placement (short: {short})")
        return proj

    def _with_interleave(self, layout: _Layout, ctx: int, proj: Dict[int, dict]) -> Dict[int, dict]:
        """Each device's layers in chunks that take turns (shorter pipeline stages), when the exact
        projection of that fits too: they hold other layers than the contiguous ranges searched."""
        used = self._used(layout)
        cpu_only = all(self.devs[d].cpu for d in used if layout.count(d))
        _, v = layer_devices([layout.count(d) for d in used], self.wanted_interleave, cpu_only)
        if v == 1:
            return proj
        pipeline = self.pipeline
        more = self._project(layout, ctx, v)
        if not self._over(more):
            self.interleave = v
            return more
        short = ", ".join(f"{name} by {format_size(b)}" for name, b in self._over(more).items())
        self.interleave_reason = f"interleave {v} did not fit (short: {short}), so each device keeps one range"
        self.pipeline = pipeline
        return proj

    # -- when it does not fit ------------------------------------------------------------------------
    def _largest_ctx(self, below: int) -> Optional[int]:
        """The largest context below `below` (in steps of CTX_STEP) that fits with everything else
        as set, checked by projecting its layout."""
        steps = list(range(self._ctx_step(), below, self._ctx_step()))
        for _ in range(_ROUNDS):
            best = largest_fitting(steps, lambda c: self._search(c, False))
            if best is None or not self._over(self._project(best[1], best[0])):
                return None if best is None else best[0]
        return None

    def _forced(self, ctx: int) -> _Layout:
        """The layout that comes closest: every device as full as it goes, the rest of the layers on
        the first device of the pipeline (whose shortfall that is)."""
        if self.layer_split is not None:
            counts = dict(zip(range(len(self.devs)), self.layer_split))
            spill = self.user_spill if self.user_spill is not None else ()
            if self.user_spill is None and self.spill_dev is not None:
                start, end = self._layout(counts, ()).range_of(self.spill_dev)
                spill = tuple(l for l in self.costs.moe_layers if not start <= l < end)
            return self._layout(counts, spill)
        spill = self.user_spill if self.user_spill is not None else \
            (tuple(self.costs.moe_layers) if len(self.tiers) > 1 else ())
        if len(self.tiers) > 1:
            counts, end = self._fill_fast(ctx, 0, spill)
            slow = self.tiers[-1]
            c, start = self._fill(slow, ctx, 0, end, end == self.L, spill)
            counts.update(zip(slow, c))
        else:
            c, start = self._fill(self.tiers[0], ctx, 0, self.L, True, spill)
            counts = dict(zip(self.tiers[0], c))
        first = self._pipeline_order()[0]
        counts[first] = counts.get(first, 0) + start
        return self._layout(counts, spill)

    def _fit_error(self, ctx: int) -> FitError:
        layout = self._forced(ctx)
        proj = self._project(layout, ctx)
        short = self._over(proj)
        parts = []
        for d, r in proj.items():
            dev = self.devs[d]
            if dev.name in short:
                parts.append(f"{dev.name} is short by {format_size(short[dev.name])} (it would need "
                             f"{format_size(r['total'])}: weights {format_size(r['weights'])}, KV {format_size(r['kv'])}, "
                             f"compute {format_size(r['compute'])}; it has {format_size(dev.free)} free "
                             f"({dev.free_source}) with a {format_size(dev.margin)} margin)")
        if "host RAM" in short:
            parts.append(f"the CPU devices together are short of the host's RAM by {format_size(short['host RAM'])} "
                         f"({format_size(self.host_free)} available, {format_size(self.host_margin)} margin)")
        if not parts:
            parts.append("no contiguous split of the layers fits the devices' free memory less their margins")
        head = {self.devs[d].name: self._total(ctx, d, self.L - 1, self.L, True, layout.spill, layout.embd_to_spill)
                - self.devs[d].room for d in layout.order}
        if min(head.values()) > 0:
            parts.append("no device has room for the output head with the last layer (the closest, " +
                         min(head, key=head.get) + f", lacks {format_size(min(head.values()))})")
        set_ctx = self.n_ctx is not None
        largest = self._largest_ctx(ctx)
        what = f"n_ctx {ctx}" + (f" ({self.set_by['n_ctx']})" if set_ctx else f" (the floor fit_ctx={self.fit_ctx})")
        msg = f"{os.path.basename(self.path)} does not fit with {what}: " + "; ".join(parts) + ". "
        fixed = [f"{k} ({v})" for k, v in self.set_by.items() if k != "n_ctx"]
        others = (" with the other settings as given" + (f" ({', '.join(fixed)})" if fixed else ""))
        if largest is not None:
            msg += f"The largest context that fits{others} is n_ctx {largest}."
        else:
            msg += f"No context fits{others}."
        return FitError(msg, short, largest)

    # -- the answer -------------------------------------------------------------------------------------
    def _placement(self, layout: _Layout, ctx: int, proj: Dict[int, dict]) -> Placement:
        overrides = self._overrides(layout)
        used = self._used(layout)
        owner = [used[i] for i in layer_devices([layout.count(d) for d in used], self.interleave)[0]]
        devices = []
        expert_home: Dict[int, set] = {}  # layer -> devices holding its experts
        for l in range(self.L):
            homes = set(self.costs.pinned_experts.get(l, ()))
            if l in self.costs.moe_layers:
                homes.add(self.spill_dev if l in layout.spill else owner[l])
            expert_home[l] = homes
        for d in layout.order:
            dev = self.devs[d]
            experts = [l for l in range(self.L) if d in expert_home[l]]
            p = DevicePlacement(spec=str(dev.spec), layers=splitting.runs([l for l in range(self.L) if owner[l] == d]),
                                expert_layers=experts, overrides=[o for o, name in overrides if name == dev.name],
                                free=dev.free, margin=dev.margin)
            if d in used:
                p.projected = {k: proj[d][k] for k in p.projected}
            else:
                p.note = self._left_out_reason(d, layout, ctx)
            devices.append(p)
        host = None
        if any(self.devs[d].cpu for d in used):
            host = {"free": self.host_free, "margin": self.host_margin,
                    "projected": sum(proj[d]["total"] for d in used if self.devs[d].cpu)}
        pl = Placement(model={"path": os.path.abspath(self.path), "arch": self.projector.arch, "n_layer": self.L,
                              "fingerprint": self.costs.fingerprint},
                       n_ctx=ctx, n_ubatch=self.n_ubatch, n_outputs=self.n_outputs, kv_type=self.kv_type,
                       devices=devices, tensor_overrides=[f"{o}={name}" for o, name in overrides], host=host,
                       n_copies=self.n_copies, n_seq=self.n_seq, pipeline=dict(self.pipeline),
                       interleave=self.interleave)
        # What a Model / Context over this placement asks for: the copies searched with, or 1.
        pl.decisions = self._decisions(layout, ctx, pl)
        return pl

    def _left_out_reason(self, d: int, layout: _Layout, ctx: int) -> str:
        dev = self.devs[d]
        other = self.devs[next(x for x in layout.order if x != d)]

        def alone(split, i):  # exactly what the device takes with `split` over [it, other] or [other, it]
            specs = [dev.spec, other.spec] if i == 0 else [other.spec, dev.spec]
            row = self.projector.project([s.as_tuple() for s in specs], split, [], ctx, self.n_ubatch, self.kv_type,
                                         self.n_outputs, self.n_copies, self.n_seq, interleave=1)["devices"][i]
            self.projections += 1
            return row["total"]

        first = alone([1, self.L - 1], 0)
        if first > dev.room:
            return (f"left out: too small for one layer plus its buffers (layer 0 needs {format_size(first)} there, "
                    f"it has {format_size(dev.room)} after its margin)")
        tier = [x for x in self._pipeline_order() if self.devs[x].tier == dev.tier]
        if self.layer_split is None and tier and tier[-1] == d and self.devs[d].tier == min(x.tier for x in self.devs):
            last = alone([self.L - 1, 1], 1)
            if last > dev.room:
                return (f"left out: the last device of the fastest tier holds the output head, and the last layer with "
                        f"it needs {format_size(last)} there; it has {format_size(dev.room)} after its margin")
        return "left out: not needed (the layers fit on faster devices)"

    def _decisions(self, layout: _Layout, ctx: int, pl: Placement) -> List[str]:
        out = []
        for dev in self.devs:
            out.append(f"{dev.name}: {format_size(dev.free)} free ({dev.free_source}), margin {format_size(dev.margin)}"
                       + (f" ({self.set_by['margin']})" if "margin" in self.set_by else " (default: min(1 GiB, memory/16))"))
        if pl.host is not None:
            out.append(f"host RAM: {format_size(self.host_free)} available for all CPU devices together, margin "
                       f"{format_size(self.host_margin)}; weights on a CPU device are read in place from the mapped "
                       "file and count in full")
        if len(self.tiers) > 1:
            out.append("fill order: " + ", then ".join(
                f"{' '.join(self.devs[d].name for d in tier)} ({_TIER_NAMES[self.devs[tier[0]].tier]})"
                for tier in self.tiers) + "; dense weights go first on the fastest"
                + (f", experts spill to {self.devs[self.spill_dev].name}" if self.spill_dev is not None
                   and self.costs.moe_layers else ""))
        # The context.
        lo, hi = self._context_range()
        if self.n_ctx is not None:
            out.append(f"n_ctx {ctx}: {self.set_by['n_ctx']}")
        elif ctx == hi:
            out.append(f"n_ctx {ctx}: the model's training context ({self.projector.n_ctx_train})"
                       + (f" capped at max_ctx {self.max_ctx}" if self.projector.n_ctx_train > self.max_ctx else ""))
        else:
            fast = ", ".join(self.devs[d].name for t in (self.tiers[:-1] if len(self.tiers) > 1 else self.tiers)
                             for d in t)
            if ctx == lo and self._search(lo, True) is None:
                out.append(f"n_ctx {hi} -> {ctx}: every layer with its KV cache did not fit on {fast} (margins kept) "
                           f"even at the floor fit_ctx {lo}, so weights move to slower memory instead")
            else:
                out.append(f"n_ctx {hi} -> {ctx}: the largest context (in steps of {CTX_STEP}, floor fit_ctx {lo}) "
                           f"with which every layer and its KV cache fit on {fast} (margins kept)")
        # What moved to slower memory.
        if layout.spill:
            host = self.devs[self.spill_dev].name
            why = (self.set_by.get("cpu_moe") or self.set_by.get("n_cpu_moe") or
                   f"dense weights first: with them on {', '.join(self.devs[d].name for t in self.tiers[:-1] for d in t)} "
                   f"the experts of these layers did not fit there")
            out.append(f"experts of layers {splitting.describe_layers(layout.spill)} -> {host}: {why}")
        if layout.embd_to_spill:
            out.append(f"{', '.join(self.costs.first_names)} -> {self.devs[self.spill_dev].name}: only the prompt's "
                       "rows are read, so it leaves room on the faster devices")
        if self.layer_split is not None:
            out.append(f"layer split {list(self.layer_split)}: {self.set_by.get('layer_split', 'set by the user')}")
        else:
            for tier in self.tiers:
                got = [(self.devs[d], layout.count(d)) for d in tier if layout.count(d)]
                if not got:
                    continue
                speeds = "/".join(str(dev.speed) for dev, _ in got)
                desc = ", ".join(f"{dev.name} {c}" for dev, c in got)
                slow_tier = len(self.tiers) > 1 and tier is self.tiers[-1]
                out.append(f"layers of {_TIER_NAMES[self.devs[tier[0]].tier]}: {desc}"
                           + (" (whole layers: they did not fit on the faster devices" +
                              (" even with every expert spilled" if self.costs.moe_layers else "") + ")"
                              if slow_tier else "")
                           + (f"; stages balanced by speed ({speeds}) within each device's room" if len(got) > 1 else ""))
        last = layout.last_device()
        if last is not None:
            out.append(f"output head -> {self.devs[last].name}: it stays with the last layer")
        holders = [d for d in layout.order if layout.count(d)]
        if len(holders) > 1:
            if self.pipeline["n_copies"] > 1:
                extra = sum(p.projected["copies"] for p in pl.devices) * (self.n_copies - 1) // self.n_copies
                out.append(f"pipeline parallelism on: {self.n_copies} copies of the tensors that cross devices "
                           f"({format_size(extra)} more than one copy), so each device works on its own "
                           "micro-batch of a long prompt")
            else:
                out.append(f"pipeline parallelism off: {self.pipeline['reason']}")
            if self.interleave > 1:
                out.append(f"interleave {self.interleave}: each device's layers in {self.interleave} ranges that take "
                           "turns with the other devices', so a pipeline stage, and the devices' wait while the "
                           f"pipeline fills and drains, is 1/{self.interleave} as long "
                           f"({self.set_by.get('interleave', 'the default')})")
            elif self.interleave_reason or "interleave" in self.set_by:
                out.append("interleave 1: one range of layers per device "
                           f"({self.interleave_reason or self.set_by['interleave']})")
            work = self.costs.work_sum
            times = {d: sum(work[b + 1] - work[a] for a, b in pl.devices[layout.order.index(d)].layers)
                     / self.devs[d].speed for d in holders}
            slowest = max(times.values())
            out.append("expected time per stage (its layers' weights read per token / its speed, slowest = 1.00): " +
                       ", ".join(f"{self.devs[d].name} {times[d] / slowest:.2f}" for d in holders))
        for p in pl.devices:
            if p.note:
                out.append(f"{p.name} {p.note}")
        for o in self.user_overrides:
            out.append(f"override {o}: {self.set_by.get('tensor_overrides', 'set by the user')}")
        out.append(f"{self.projections} projection{'s' if self.projections > 1 else ''} by the core's planner; the "
                   "last one is this placement")
        return out


# ---- entry point -----------------------------------------------------------------------------------

def fit(model: Union[str, os.PathLike], devices=None, *, n_ctx: Optional[int] = None,
        n_ubatch: Optional[int] = None, n_outputs: Optional[int] = None, kv_type: Optional[str] = None,
        n_copies: Optional[int] = None, n_seq: int = 1, layer_split: Optional[Sequence[int]] = None, tensor_overrides: Optional[Sequence[str]] = None,
        cpu_moe: bool = False, n_cpu_moe: Optional[int] = None, margin=None, max_ctx: int = DEFAULT_MAX_CTX,
        fit_ctx: int = DEFAULT_FIT_CTX, placement: Optional[Union[Placement, str, os.PathLike]] = None,
        split_mode: Optional[str] = "layer", tensor_split: Optional[Sequence[float]] = None,
        interleave: Optional[int] = None) -> Placement:
    """Decide a placement of the GGUF file `model` on `devices` (a list or "cpu:0[...],cuda:0";
    "auto": every CUDA device and the CPU). Every argument given is kept as is; FitError (a
    MemoryError) says which device is short, by how much, and the largest context that fits.
    `placement` starts from a saved placement: all of its values count as set, so fitting a
    fitted placement gives it back. interleave: each device's layers in that many ranges that
    take turns with the other devices' (default 2 where two or more CPU devices and no GPU hold
    layers, and it fits; 1: one range each). split_mode="tensor" or "tensor-sum": every layer cut
    over the devices (stowlm.tensor_split decides the shares unless tensor_split gives them).
    Allocates nothing."""
    path = os.fspath(model)
    if not os.path.exists(path):
        raise ValueError(f"model file {path!r} does not exist")
    set_by: Dict[str, str] = {}
    for key, value in (("n_ctx", n_ctx), ("n_ubatch", n_ubatch), ("n_outputs", n_outputs), ("kv_type", kv_type),
                       ("n_copies", n_copies), ("layer_split", layer_split), ("margin", margin),
                       ("n_cpu_moe", n_cpu_moe), ("interleave", interleave)):
        if value is not None:
            set_by[key] = "set by the user"
    if tensor_overrides:
        set_by["tensor_overrides"] = "set by the user"
    if cpu_moe:
        set_by["cpu_moe"] = "set by the user (--cpu-moe)"
    if n_cpu_moe is not None:
        set_by["n_cpu_moe"] = f"set by the user (--n-cpu-moe {n_cpu_moe})"
    split_mode = split_mode or "layer"
    check_split_mode(split_mode)
    if tensor_split is not None and split_mode == "layer":
        raise ValueError("tensor_split needs split_mode='tensor' or 'tensor-sum'")
    if placement is not None:
        if not isinstance(placement, Placement):
            placement = Placement.load(placement)
        if placement.split_mode != "layer":
            split_mode, tensor_split = placement.split_mode, placement.tensor_split
            devices = [d.spec for d in placement.used_devices]
            placement_margins = [d.margin for d in placement.used_devices]
            n_ctx, n_ubatch, n_outputs, kv_type = placement.n_ctx, placement.n_ubatch, placement.n_outputs, \
                placement.kv_type
            n_seq = placement.n_seq
            if margin is None:
                margin = placement_margins
            set_by = {k: "set by the placement" for k in ("n_ctx", "n_ubatch", "n_outputs", "kv_type", "margin")}
            placement = None
        conflict = [k for k in ("n_ctx", "n_copies", "layer_split", "tensor_overrides", "cpu_moe", "n_cpu_moe",
                                "interleave") if k in set_by]
        if conflict or devices is not None:
            raise ValueError("fit: a placement fixes the devices, " + ", ".join(conflict or ["devices"]) +
                             "; give either the placement or these")
        devices = [d.spec for d in placement.devices]
        n_ctx, n_ubatch, n_outputs, kv_type = placement.n_ctx, placement.n_ubatch, placement.n_outputs, \
            placement.kv_type
        n_copies, interleave = placement.n_copies, placement.interleave
        layer_split = [d.n_layers for d in placement.devices]
        tensor_overrides = list(placement.tensor_overrides)
        if margin is None:
            margin = [d.margin for d in placement.devices]
        set_by = {k: "set by the placement" for k in ("n_ctx", "n_ubatch", "n_outputs", "kv_type", "n_copies",
                                                       "layer_split", "margin", "tensor_overrides", "interleave")}
        mine = fingerprint(path)
        if placement.model.get("fingerprint") != mine:
            raise ValueError(f"the placement was made for another model ({placement.model.get('path')}, "
                             f"{placement.model.get('arch')}, fingerprint {placement.model.get('fingerprint')}), "
                             f"not {path} (fingerprint {mine})")
    specs = parse_devices(devices)
    n_ubatch = DEFAULT_N_UBATCH if n_ubatch is None else int(n_ubatch)
    if n_ubatch <= 0:
        raise ValueError(f"n_ubatch must be positive, got {n_ubatch}")
    if n_ctx is not None and int(n_ctx) <= 0:
        raise ValueError(f"n_ctx must be positive, got {n_ctx}")
    if fit_ctx <= 0 or max_ctx <= 0:
        raise ValueError("fit_ctx and max_ctx must be positive")
    n_outputs = min(DEFAULT_N_OUTPUTS, n_ubatch) if n_outputs is None else int(n_outputs)
    if not 0 < n_outputs <= n_ubatch:
        raise ValueError(f"n_outputs must be in [1, n_ubatch={n_ubatch}], got {n_outputs}")
    kv_type = kv_type or "f16"
    n_copies = _n_copies(DEFAULT_N_COPIES if n_copies is None else n_copies)
    _interleave(interleave)
    devs, host_free, host_margin = _describe_devices(specs, margin)
    if placement is not None:
        n_seq = placement.n_seq
    if isinstance(n_seq, bool) or not isinstance(n_seq, int) or n_seq < 1:
        raise ValueError(f"n_seq must be a positive integer, got {n_seq!r}")
    if split_mode != "layer":
        from .engine import _tensor_split
        from .tensor_split import fit_tensor

        if cpu_moe or n_cpu_moe is not None:
            raise ValueError("--cpu-moe / --n-cpu-moe place experts by layers: not with a tensor split")
        shares = None if tensor_split is None else _tensor_split(split_mode, tensor_split, len(specs), layer_split,
                                                                 None, tensor_overrides)
        if shares is None:
            _tensor_split(split_mode, None, len(specs), layer_split, None, tensor_overrides)
        return fit_tensor(path, devs, host_free, host_margin, split_mode=split_mode, shares=shares,
                          n_ctx=None if n_ctx is None else slot_context(n_ctx, n_seq), n_ubatch=n_ubatch,
                          n_outputs=n_outputs, kv_type=kv_type, n_seq=n_seq, max_ctx=int(max_ctx),
                          fit_ctx=int(fit_ctx), set_by=set_by, fingerprint=fingerprint(path),
                          ctx_step=CTX_STEP * n_seq)
    fitter = _Fitter(path, devs, host_free, host_margin, n_ctx=None if n_ctx is None else slot_context(n_ctx, n_seq),
                     n_ubatch=n_ubatch, n_outputs=n_outputs, kv_type=kv_type, n_copies=n_copies, n_seq=n_seq,
                     layer_split=layer_split,
                     user_overrides=tensor_overrides, cpu_moe=cpu_moe, n_cpu_moe=n_cpu_moe, max_ctx=int(max_ctx),
                     fit_ctx=int(fit_ctx), set_by=set_by, interleave=interleave)
    return fitter.solve()


def fingerprint(path: Union[str, os.PathLike]) -> str:
    """The identity a placement records of its model file (architecture, weight names and sizes)."""
    return _Costs(_core.engine.Projector(os.fspath(path)), [], [], "f16").fingerprint


def fits_one_device(projector, device: DeviceSpec, n_ctx: int, n_ubatch: int, kv_type: str, n_outputs: int,
                    margin=None, n_seq: int = 1) -> bool:
    """Whether the model (a _core.engine.Projector of its file) with these settings fits `device`
    alone: its free memory less its margin."""
    devs, host_free, host_margin = _describe_devices([device], margin)
    total = projector.project([device.as_tuple()], [], [], n_ctx, n_ubatch, kv_type, n_outputs, 1,
                              n_seq)["devices"][0]["total"]
    return total <= devs[0].room and (device.kind != "cpu" or total <= host_free - host_margin)


__all__ += ["fingerprint", "fits_one_device", "host_available_bytes"]
