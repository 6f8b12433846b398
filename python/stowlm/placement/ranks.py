"""The layers of each device of an MPI job (stowlm.mpi decides the rooms, this the split): in
proportion to each device's room, then corrected by the core's projection of the whole job."""
from __future__ import annotations

from typing import List, Sequence, Tuple

from ..devices import DeviceSpec
from .budgets import shares_of
from .data import format_size
from .rules import DEFAULT_N_OUTPUTS, plan


def split_over_ranks(path: str, devices: List[DeviceSpec], room: Sequence[int], hosts: Sequence[str], n_ctx: int,
                     n_ubatch: int, kv_type: str, overrides, decisions: List[str]) -> Tuple[List[int], List[dict]]:
    """Layers per device over every rank's devices, and each device's projected row: in
    proportion to each device's room (bytes it may take; hosts[i] is where device i is), then
    moved one at a time from a device the core's projection puts over its room to the one with
    the most room left, until every device fits (MemoryError when none can take it)."""
    from ..gguffile import GGUFFile

    with GGUFFile(path) as f:
        meta = f.metadata
    n_layer = int(meta[f"{meta['general.architecture']}.block_count"])
    quota = shares_of(room, n_layer)
    split = [int(q) for q in quota]
    for i in sorted(range(len(split)), key=lambda i: quota[i] - split[i], reverse=True)[:n_layer - sum(split)]:
        split[i] += 1  # the layers rounding left over, to the largest remainders
    decisions.append("layers in proportion to each device's room (free memory less its margin; ranks of one "
                     f"host share its RAM): {split}")
    for _ in range(n_layer * len(devices) + 1):
        rows = plan(path, devices=devices, layer_split=split, n_ctx=n_ctx, n_ubatch=n_ubatch, kv_type=kv_type,
                    tensor_overrides=overrides, n_outputs=min(n_ubatch, DEFAULT_N_OUTPUTS))
        over = [rows[i]["total"] - room[i] for i in range(len(devices))]
        worst = max(range(len(devices)), key=lambda i: over[i])
        if over[worst] <= 0:
            return split, rows
        spare = [i for i in range(len(devices)) if i != worst and over[i] < 0]
        if split[worst] == 0 or not spare:
            raise MemoryError(f"the model does not fit the devices of the MPI job with n_ctx {n_ctx}: "
                              f"{devices[worst].name} on {hosts[worst]} is short by {format_size(over[worst])} "
                              f"(it needs {format_size(rows[worst]['total'])}, its room is {format_size(room[worst])}) "
                              "and no other device has room for its layers")
        to = min(spare, key=lambda i: over[i])
        split[worst] -= 1
        split[to] += 1
        decisions.append(f"a layer {devices[worst].name} -> {devices[to].name}: {devices[worst].name} was "
                         f"{over[worst]} bytes over its room")
    raise MemoryError("the layer split over the MPI job's devices did not settle")
