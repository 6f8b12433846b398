"""What each device may take: its free memory less its margin (its room), and the host's RAM that
all CPU devices share. Every fitter (layers, tensor split, MPI ranks) measures against these.

Free memory: a virtual device's budget; a CUDA device's free memory (``cudaMemGetInfo``, capped by
its ``mem`` budget); for a CPU device without a budget the host's available RAM (MemAvailable).
Margin: what stays free on each device, by default min(1 GiB, the device's memory / 16).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from .. import _core
from ..devices import DeviceSpec, cuda_devices, parse_bytes
from .data import format_size

MARGIN_MAX = 1 << 30
MARGIN_DIVISOR = 16


class FitError(MemoryError):
    """The model does not fit with the values the user set. ``shortfalls`` maps each device that
    is short to the bytes it lacks; ``largest_ctx`` is the largest context that fits with the
    other settings as given (None when none does)."""

    def __init__(self, message: str, shortfalls: Optional[Dict[str, int]] = None,
                 largest_ctx: Optional[int] = None):
        super().__init__(message)
        self.shortfalls = dict(shortfalls or {})
        self.largest_ctx = largest_ctx


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


@dataclass
class Dev:
    """A device as the fitters see it."""
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


def margins(margin, n: int) -> List[Optional[int]]:
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


def describe_devices(specs: List[DeviceSpec], margin, reserved: Optional[Dict[str, int]] = None
                     ) -> Tuple[List[Dev], int, int]:
    """Free memory, margin, speed and tier of each device; and the host's available RAM and margin.
    reserved: bytes another model of this process holds on a CPU device (a draft model), which
    its budget and the host's RAM do not show (a CUDA device's free memory already does)."""
    per_device = margins(margin, len(specs))
    host_total, host_free = physical_ram_bytes(), host_available_bytes()
    held = {s.name: int((reserved or {}).get(s.name, 0)) for s in specs if s.kind == "cpu"}
    host_free -= sum(held.values())
    host_margin = default_margin(host_total)
    default_threads = _core.engine.default_threads()
    out = []
    for i, (s, m) in enumerate(zip(specs, per_device)):
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
        if held.get(s.name):
            free -= held[s.name]
            source += f", less {format_size(held[s.name])} held by the draft model"
        m = default_margin(total) if m is None else m
        if m >= free:
            raise ValueError(f"margin {format_size(m)} for {s.name} is not smaller than its free memory "
                             f"({format_size(free)}, {source})")
        out.append(Dev(i, s, total, free, m, speed, tier, source))
    return out, host_free, host_margin


def shares_of(rooms: Sequence[int], whole=1.0) -> List[float]:
    """`whole` cut in proportion to the devices' rooms (a device without room gets none)."""
    rooms = [max(r, 0) for r in rooms]
    total = sum(rooms)
    return [whole * r / total for r in rooms] if total else [0.0] * len(rooms)


def over(devs: Sequence[Dev], totals: Sequence[int], host_free: int, host_margin: int) -> Dict[str, int]:
    """Device name -> bytes over its room, for every device short; while none is, "host RAM" when
    the CPU devices together are over the host's available RAM less its margin."""
    short = {d.name: t - d.room for d, t in zip(devs, totals) if t > d.room}
    host = sum(t for d, t in zip(devs, totals) if d.cpu) - (host_free - host_margin)
    if host > 0 and not short:
        short["host RAM"] = host
    return short


def shortfalls(rows: Iterable[Tuple[Dev, dict]], lack: Dict[str, int], host_free: int, host_margin: int) -> List[str]:
    """One sentence per device short (what it would need, what it has), and one for the host."""
    parts = [f"{dev.name} is short by {format_size(lack[dev.name])} (it would need {format_size(r['total'])}: "
             f"weights {format_size(r['weights'])}, KV {format_size(r['kv'])}, compute {format_size(r['compute'])}; "
             f"it has {format_size(dev.free)} free ({dev.free_source}) with a {format_size(dev.margin)} margin)"
             for dev, r in rows if dev.name in lack]
    if "host RAM" in lack:
        parts.append(f"the CPU devices together are short of the host's RAM by {format_size(lack['host RAM'])} "
                     f"({format_size(host_free)} available, {format_size(host_margin)} margin)")
    return parts


def ctx_given(ctx: int, set_by: Dict[str, str], fit_ctx: int) -> str:
    """The context a FitError is about, and who set it."""
    return f"n_ctx {ctx}" + (f" ({set_by['n_ctx']})" if "n_ctx" in set_by else f" (the floor fit_ctx={fit_ctx})")


def host_record(devs: Sequence[Dev], totals: Sequence[int], host_free: int, host_margin: int):
    """What a placement records of the host's RAM the CPU devices among `devs` (those it loads onto)
    share; None when none is a CPU device."""
    if not any(d.cpu for d in devs):
        return None
    return {"free": host_free, "margin": host_margin, "projected": sum(t for d, t in zip(devs, totals) if d.cpu)}


def fits_one_device(projector, device: DeviceSpec, n_ctx: int, n_ubatch: int, kv_type: str, n_outputs: int,
                    margin=None, n_seq: int = 1, reserved: Optional[Dict[str, int]] = None,
                    embeddings: bool = False) -> bool:
    """Whether the model (a _core.engine.Projector of its file) with these settings fits `device`
    alone: its free memory less its margin (and less what `reserved` says is held there)."""
    devs, host_free, host_margin = describe_devices([device], margin, reserved)
    total = projector.project([device.as_tuple()], [], [], n_ctx, n_ubatch, kv_type, n_outputs, 1,
                              n_seq, embeddings=embeddings)["devices"][0]["total"]
    return not over(devs, [total], host_free, host_margin)
