"""What each piece of a model costs, in bytes, from the core's own accounting (the same code that
allocates): per layer its dense weights, its expert weights and its KV cache; the input
embedding and the output head; weights the user's overrides pin to a device. And the model's
identity a placement records (its fingerprint), checked before a placement is used.
"""
from __future__ import annotations

import hashlib
import os
import re
from typing import Dict, List, Sequence, Tuple, Union

from .. import _core
from .rules import DEFAULT_KV_TYPE

# An expert tensor of a mixture-of-experts layer (ffn_gate_exps.weight, ffn_down_exps.bias, ...).
EXPERT_NAME = re.compile(r"^blk\.(\d+)\.[a-z0-9_]*_exps\.")


def prefix(values: Sequence[int]) -> List[int]:
    """Prefix sums: out[i] is the sum of values[:i]."""
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


class Costs:
    """Bytes of every piece of the model: per layer its dense weights, its expert weights and its
    KV cache; the input embedding (with the first device unless moved) and the output head (with
    the last); weights the user's overrides pin to a device. Sizes are kept for both kinds of
    device (key True: CPU, read in place; False: GPU, packed)."""

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
            expert = EXPERT_NAME.match(name)
            if anchor >= 0:
                work[anchor] += elements * (used if expert else 1.0)
            size = {True: nbytes, False: packed}
            if hit >= 0:
                if expert:
                    self.pinned_experts.setdefault(int(expert.group(1)), set()).add(override_devices[hit])
                pin = self.pinned.setdefault(override_devices[hit], {True: 0, False: 0})
                for k in size:
                    pin[k] += size[k]
                continue
            if anchor >= 0:
                part = self.expert if expert else self.dense
                if expert:
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
        self._dense_sum = {k: prefix(v) for k, v in self.dense.items()}
        self._expert_sum = {k: prefix(v) for k, v in self.expert.items()}
        self._moe_count = prefix([1 if l in moe else 0 for l in range(n)])
        self.work_sum = prefix(work)
        self._kv: Dict[int, List[int]] = {}
        self._spill: Dict[Tuple[int, ...], tuple] = {}

    def spilled(self, spill: Tuple[int, ...]) -> tuple:
        """Prefix sums over the layers of a spill set: expert bytes (CPU, GPU) and layer count."""
        if spill not in self._spill:
            s = set(spill)
            self._spill[spill] = ({k: prefix([v[l] if l in s else 0 for l in range(self.n_layer)])
                                   for k, v in self.expert.items()},
                                  prefix([1 if l in s else 0 for l in range(self.n_layer)]))
        return self._spill[spill]

    def kv_sum(self, ctx: int) -> List[int]:
        """Prefix sums of the KV bytes of the layers at this context."""
        if ctx not in self._kv:
            self._kv[ctx] = prefix(self.projector.kv_layer_bytes(ctx, self.kv_type))
        return self._kv[ctx]

    def layers_bytes(self, cpu: bool, start: int, end: int) -> int:
        return (self._dense_sum[cpu][end] - self._dense_sum[cpu][start] + self._expert_sum[cpu][end] -
                self._expert_sum[cpu][start])

    def n_moe(self, start: int, end: int) -> int:
        return self._moe_count[end] - self._moe_count[start]


def fingerprint(path: Union[str, os.PathLike]) -> str:
    """The identity a placement records of its model file (architecture, weight names and sizes)."""
    return Costs(_core.engine.Projector(os.fspath(path)), [], [], DEFAULT_KV_TYPE).fingerprint


def model_record(path, projector, fingerprint: str) -> Dict[str, object]:
    """What a placement records of the model it was made for."""
    return {"path": os.path.abspath(path), "arch": projector.arch, "n_layer": projector.n_layer,
            "fingerprint": fingerprint}


def check_made_for(placement, path) -> None:
    """ValueError unless `placement` was made for the model file at `path`."""
    mine = fingerprint(path)
    if placement.model.get("fingerprint") != mine:
        raise ValueError(f"the placement was made for another model ({placement.model.get('path')}, "
                         f"{placement.model.get('arch')}, fingerprint {placement.model.get('fingerprint')}), not "
                         f"{path} (fingerprint {mine})")
