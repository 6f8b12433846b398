"""Device specs: "cpu", "cpu:1", "cpu:0[threads=1,mem=512MiB]", "cuda:0", "cuda:1[mem=8GiB]".

`speed=X` states a device's relative speed for fit's pipeline stages where the default (a CPU
device's threads, 1 for a GPU) misleads, e.g. "cpu:0[threads=2,speed=1.6],cpu:1[threads=1]".

Under mpirun (stowlm.mpi) a device of MPI rank R is "cpu:0@R" (or "cpu:0[rank=R]"): one device
list then names the devices of every rank, and each rank runs the layers of its own.

A CPU device with a `mem` budget is a virtual device: it refuses allocations past the budget
exactly as a GPU would (MemoryError naming the device), which is how multi-device placement is
exercised on a machine without GPUs.

The grammar itself is the core's (csrc/backend/device_spec.h), so stowlm-bench reads the same
lists; this module adds what only a running process knows (is there such a CUDA device here).
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Union

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


def gpu_layers(n_gpu_layers: int, n_layer: int, flag: str = "n_gpu_layers", threads: Optional[int] = None):
    """llama.cpp's -ngl as (devices, layer_split): 0 none (None, None: the default CPU); all of
    them (-1, or n_layer or more) cuda:0 and the CPU, fit deciding what stays in RAM when the GPU
    is too small; fewer the last ones on cuda:0. Without a CUDA device: a warning and the CPU, as
    llama.cpp's CPU builds do. threads: the CPU device's, where devices are given."""
    if n_gpu_layers == 0:
        return None, None
    if n_gpu_layers < -1:
        raise ValueError(f"{flag} must be -1 (all), 0 or a number of layers, got {n_gpu_layers}")
    found, why = cuda_devices()
    if not found:
        given = f"{flag} {n_gpu_layers}" if flag.startswith("-") else f"{flag}={n_gpu_layers}"
        warnings.warn(f"{given}, but {why}: the model runs on the CPU", RuntimeWarning, stacklevel=3)
        return None, None
    cpu = "cpu:0" if threads is None else f"cpu:0[threads={threads}]"
    if n_gpu_layers < 0 or n_gpu_layers >= n_layer:
        return ["cuda:0", cpu], None
    return [cpu, "cuda:0"], [n_layer - n_gpu_layers, n_gpu_layers]


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
    """"512MiB", "2GiB", "1.5G", "1000000" -> bytes (the core's grammar, backend/device_spec.h)."""
    from . import _core

    return _core.engine.parse_bytes(str(text))


def format_bytes(n: int) -> str:
    from . import _core

    return _core.engine.format_bytes(int(n))


def parse_device(text: str) -> DeviceSpec:
    """One device spec, read by the core's grammar (the one stowlm-bench reads too); then whether
    a CUDA device of this process exists."""
    from . import _core

    return _checked(_core.engine.parse_device(str(text)), text)


def _checked(fields, text: str) -> DeviceSpec:
    kind, index, threads, mem, rank, speed = fields
    if kind == "cuda" and not _elsewhere(rank):
        devs, why = cuda_devices()
        if not devs:
            raise RuntimeError(f"device {text!r}: no CUDA device is present ({why})")
        if index >= len(devs):
            raise ValueError(f"device {text!r}: there are {len(devs)} CUDA devices (cuda:0..cuda:{len(devs) - 1})")
    return DeviceSpec(kind, index, threads, mem, rank, speed)


def _elsewhere(rank: int) -> bool:
    """Whether a device of MPI rank `rank` is another process's (its own rank checks it)."""
    if rank < 0:
        return False
    from . import _core

    return rank != _core.dist.rank()


def parse_devices(devices: Union[None, str, DeviceSpec, Iterable[Union[str, DeviceSpec]]]) -> List[DeviceSpec]:
    """A device list from None (one CPU device), "auto" (every CUDA device, then the CPU),
    "cpu:0[...],cpu:1[...]", or a list of specs."""
    if devices is None:
        return [DeviceSpec()]
    if isinstance(devices, str) and devices.strip().lower() == "auto":
        return [DeviceSpec("cuda", d["index"]) for d in cuda_devices()[0]] + [DeviceSpec()]
    if isinstance(devices, DeviceSpec):
        return [devices]
    if isinstance(devices, str):  # the core reads the whole list (its duplicates, its brackets)
        from . import _core

        return [_checked(f, f"{f[0]}:{f[1]}") for f in _core.engine.parse_devices(devices)]
    items: Sequence = list(devices)
    out = [d if isinstance(d, DeviceSpec) else parse_device(str(d)) for d in items]
    if not out:
        raise ValueError("devices: empty device list")
    names = [d.name for d in out]
    for n in names:
        if names.count(n) > 1:
            raise ValueError(f"devices: {n} appears more than once")
    return out
