"""Device specs: "cpu", "cpu:1", "cpu:0[threads=1,mem=512MiB]", "cuda:0", "cuda:1[mem=8GiB]".

`speed=X` states a device's relative speed for fit's pipeline stages where the default (a CPU
device's threads, 1 for a GPU) misleads, e.g. "cpu:0[threads=2,speed=1.6],cpu:1[threads=1]".

Under mpirun (stowlm.mpi) a device of MPI rank R is "cpu:0@R" (or "cpu:0[rank=R]"): one device
list then names the devices of every rank, and each rank runs the layers of its own.

A CPU device with a `mem` budget is a virtual device: it refuses allocations past the budget
exactly as a GPU would (MemoryError naming the device), which is how multi-device placement is
exercised on a machine without GPUs.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Iterable, List, Sequence, Union

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4,
          "tib": 1 << 40}
_SPEC = re.compile(r"^\s*([a-z]+)(?::(\d+))?(?:@(\d+))?\s*(?:\[(.*)\])?\s*$", re.IGNORECASE)
KINDS = ("cpu", "cuda")
_log = logging.getLogger("stowlm")
_cuda_cache = None


def cuda_devices():
    """(CUDA devices as dicts, why there are none). Queried once; the absence is logged once."""
    global _cuda_cache
    if _cuda_cache is None:
        from . import _core

        devs, why = _core.cuda.devices()
        _cuda_cache = (list(devs), why)
        if not devs:
            _log.info("stowlm: no CUDA device (%s); running on the CPU", why)
    return _cuda_cache


def list_devices() -> List[dict]:
    """Every device this machine offers: the CPU, then each CUDA device (none where absent)."""
    from . import _core

    out = [{"name": "cpu:0", "kind": "cpu", "threads": _core.engine.default_threads()}]  # the cores it may use
    for d in cuda_devices()[0]:
        out.append(dict(d, name=f"cuda:{d['index']}", kind="cuda"))
    return out


@dataclass(frozen=True)
class DeviceSpec:
    kind: str = "cpu"
    index: int = 0
    threads: int = 0      # 0: all cores (or STOWLM_THREADS)
    mem_bytes: int = 0    # 0: no budget beyond physical RAM
    rank: int = -1        # the MPI rank whose device it is; -1: this process's
    speed: float = 0.0    # relative speed for fit's stage balance; 0: its threads (CPU), 1 (CUDA)

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.index}" + (f"@{self.rank}" if self.rank >= 0 else "")

    def as_tuple(self):
        return (self.kind, self.index, self.threads, self.mem_bytes, self.rank)

    def __str__(self) -> str:
        opts = []
        if self.threads:
            opts.append(f"threads={self.threads}")
        if self.mem_bytes:
            opts.append(f"mem={format_bytes(self.mem_bytes)}")
        if self.speed:
            opts.append(f"speed={self.speed:g}")
        return self.name + (f"[{','.join(opts)}]" if opts else "")


def parse_bytes(text: str) -> int:
    """"512MiB", "2GiB", "1.5G", "1000000" -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse memory size {text!r} (use e.g. 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def parse_device(text: str) -> DeviceSpec:
    m = _SPEC.match(text)
    if not m:
        raise ValueError(f"cannot parse device {text!r} (expected e.g. cpu, cpu:1, cpu:0[threads=2,mem=1GiB])")
    kind = m.group(1).lower()
    if kind not in KINDS:
        raise ValueError(f"device {text!r}: unknown kind {kind!r} (known: {', '.join(KINDS)})")
    index = int(m.group(2) or 0)
    rank = -1 if m.group(3) is None else int(m.group(3))
    options = m.group(4)
    if options and re.search(r"(^|,)\s*rank\s*=", options):
        items = [i for i in options.split(",") if i.split("=", 1)[0].strip() != "rank"]
        value = [i for i in options.split(",") if i.split("=", 1)[0].strip() == "rank"][-1].split("=", 1)[1].strip()
        if not value.isdigit() or (rank >= 0 and int(value) != rank):
            raise ValueError(f"device {text!r}: rank must be a non-negative integer (and agree with @RANK)")
        rank, options = int(value), ",".join(items)
    if kind == "cuda" and not _elsewhere(rank):
        devs, why = cuda_devices()
        if not devs:
            raise RuntimeError(f"device {text!r}: no CUDA device is present ({why})")
        if index >= len(devs):
            raise ValueError(f"device {text!r}: there are {len(devs)} CUDA devices (cuda:0..cuda:{len(devs) - 1})")
    threads, mem, speed = 0, 0, 0.0
    if options is not None and options.strip():
        for item in options.split(","):
            if "=" not in item:
                raise ValueError(f"device {text!r}: option {item.strip()!r} is not key=value")
            key, value = (s.strip() for s in item.split("=", 1))
            if key == "threads":
                if not value.isdigit() or int(value) < 1:
                    raise ValueError(f"device {text!r}: threads must be a positive integer, got {value!r}")
                threads = int(value)
            elif key == "mem":
                mem = parse_bytes(value)
                if mem <= 0:
                    raise ValueError(f"device {text!r}: mem must be positive")
            elif key == "speed":
                try:
                    speed = float(value)
                except ValueError:
                    speed = -1.0
                if not (0 < speed < float("inf")):
                    raise ValueError(f"device {text!r}: speed must be a positive number, got {value!r}")
            else:
                raise ValueError(f"device {text!r}: unknown option {key!r} (known: threads, mem, speed, rank)")
    if kind == "cuda" and threads:
        raise ValueError(f"device {text!r}: threads applies to CPU devices only (a CUDA device takes mem)")
    return DeviceSpec(kind, index, threads, mem, rank, speed)


def _elsewhere(rank: int) -> bool:
    """Whether a device of MPI rank `rank` is another process's (its own rank checks it)."""
    if rank < 0:
        return False
    from . import _core

    return rank != _core.dist.rank()


def _split_outside_brackets(text: str) -> List[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p for p in (s.strip() for s in parts) if p]


def parse_devices(devices: Union[None, str, DeviceSpec, Iterable[Union[str, DeviceSpec]]]) -> List[DeviceSpec]:
    """A device list from None (one CPU device), "auto" (every CUDA device, then the CPU),
    "cpu:0[...],cpu:1[...]", or a list of specs."""
    if devices is None:
        return [DeviceSpec()]
    if isinstance(devices, str) and devices.strip().lower() == "auto":
        return [DeviceSpec("cuda", d["index"]) for d in cuda_devices()[0]] + [DeviceSpec()]
    if isinstance(devices, DeviceSpec):
        return [devices]
    if isinstance(devices, str):
        items: Sequence = _split_outside_brackets(devices)
    else:
        items = list(devices)
    out = [d if isinstance(d, DeviceSpec) else parse_device(str(d)) for d in items]
    if not out:
        raise ValueError("devices: empty device list")
    names = [d.name for d in out]
    for n in names:
        if names.count(n) > 1:
            raise ValueError(f"devices: {n} appears more than once")
    return out
