"""What a layer fit works on: the settings as given, the devices in tiers, the spill device, the
byte costs of the model's pieces, and what the fit has learnt and chosen so far (compute buffers
seen in projections, copies, interleave). The decisions themselves are in layer_costs (a device's
bytes in a layout), layer_search (the layout), projection (the core's exact answer), upgrades
(copies, interleave) and explain (why)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .. import _core
from .budgets import Dev
from .costs import Costs
from .rules import DEFAULT_MOE_OFFLOAD_MIN, _tensor_overrides, tensor_names

ROUNDS = 64  # projections that may correct a compute-buffer estimate before fit gives up
TIER_NAMES = {0: "GPU memory", 1: "CPU devices with a budget", 2: "the host's RAM"}


@dataclass(frozen=True)
class Layout:
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


class LayerProblem:
    def __init__(self, path: str, devs: List[Dev], host_free: int, host_margin: int, *, n_ctx, n_ubatch,
                 n_outputs, kv_type, n_copies, n_seq, layer_split, user_overrides, cpu_moe, n_cpu_moe, max_ctx,
                 fit_ctx, set_by: Dict[str, str], interleave: Optional[int] = None,
                 moe_offload_min: int = DEFAULT_MOE_OFFLOAD_MIN):
        self.path, self.devs = path, devs
        self.host_free, self.host_margin = host_free, host_margin
        self.n_ubatch, self.n_outputs, self.kv_type, self.n_seq = n_ubatch, n_outputs, kv_type, n_seq
        # Searched with one copy unless the user set it (see upgrades.with_copies).
        self.wanted_copies = n_copies
        self.n_copies = n_copies if "n_copies" in set_by else 1
        self.n_ctx, self.max_ctx, self.fit_ctx = n_ctx, max_ctx, fit_ctx
        self.moe_offload_min = moe_offload_min  # staged experts count in the GPU's compute buffer
        self.set_by = set_by
        # Searched with contiguous ranges, then interleaved if that fits too (see upgrades.with_interleave).
        self.wanted_interleave, self.interleave, self.interleave_reason = interleave, 1, ""
        self.projector = _core.engine.Projector(path)
        self.L = self.projector.n_layer
        specs = [d.spec for d in devs]
        self.user_overrides = list(user_overrides or [])
        self.names = tensor_names(path)  # the file's: overrides reach the core as the names they match
        native = _tensor_overrides(self.user_overrides, specs, self.names)
        self.costs = Costs(self.projector, native, [o[1] for o in native], kv_type)
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
        self.observed: Dict[tuple, int] = {}  # compute buffer per role, learnt from projections
        self.projections = 0
        self.pipeline: Dict[str, object] = {}  # the core's answer for the last projection
