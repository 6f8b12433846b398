"""What each rank's pipeline stage holds: every rank's devices with their free memory, the room
each may take, the layers of each device and the context (decided on rank 0, the same on every
rank), and a rank other than 0 serving its share."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

from .. import _core
from ..devices import DeviceSpec, parse_devices
from ..placement.budgets import default_margin, describe_devices
from ..placement.rules import DEFAULT_KV_TYPE, DEFAULT_N_OUTPUTS, DEFAULT_N_UBATCH
from . import job as jobs
from .context import fit_ctx, llm_ctx
from .job import Job, agree


def pull_on_each_host(job: Job, model: str, progress: bool) -> str:
    """The model's path on this rank: pulled (or found) by the first rank of each host, then by
    the others there (which find it cached)."""
    from ..pull import pull

    local = [r for r in range(job.size) if job.hosts[r] == job.hosts[job.rank]].index(job.rank)
    rounds = max(sum(1 for h in job.hosts if h == host) for host in set(job.hosts))
    path = None
    for turn in range(rounds):
        mine = (lambda: pull(model, progress=progress and job.rank == 0)) if local == turn else (lambda: None)
        got = agree(job, mine, f"could not find the model {model!r}")
        if local == turn:
            path = got[job.rank]
    return os.fspath(path)


def describe(specs: List[DeviceSpec], ranks_here: int) -> List[dict]:
    """This rank's devices with their free memory, as fit counts it. A CPU device without a
    thread count gets this host's cores shared by the ranks on it."""
    threads = _core.engine.default_threads()  # the cores this rank may use (or STOWLM_THREADS)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    bound = cores < (os.cpu_count() or cores)  # the launcher bound this rank to some cores
    mine = []
    for s in specs:
        if s.kind == "cpu" and not s.threads:
            s = replace(s, threads=max(1, threads if bound else threads // ranks_here), rank=-1)
        if s.kind == "cpu" and bound and s.threads > cores:
            print(f"stowlm: warning on rank {_core.dist.rank()}: {s.name} asks for {s.threads} threads, but mpirun "
                  f"bound this rank to {cores} core{'s' if cores > 1 else ''} (its default for 2 ranks or fewer); "
                  f"launch with --bind-to none, or --map-by slot:PE={s.threads} to give each rank its cores",
                  file=sys.stderr)
        mine.append(s)
    devs = describe_devices(mine, 0)[0]  # the margin comes later, from each device's share (room())
    return [dict(spec=str(s), kind=s.kind, index=s.index, threads=s.threads, mem=s.mem_bytes, total=d.total,
                 free=d.free, source=d.free_source) for s, d in zip(mine, devs)]


@dataclass
class Setup:
    path: str
    devices: List[DeviceSpec]             # every rank's, in rank order (dev@RANK)
    layer_split: List[int]
    n_ctx: int                            # of all slots together, as the split was projected
    tensor_overrides: Optional[List[str]]
    described: List[dict]                 # per device of `devices`: rank, host, free memory, source
    decisions: List[str]


def room(described: List[dict], margin) -> List[int]:
    """Bytes each device may take: its free memory less the margin; the ranks of one host that
    use its RAM without a budget share it."""
    shared = {}
    for d in described:
        if d["kind"] == "cpu" and not d["mem"]:
            shared[d["host"]] = shared.get(d["host"], 0) + 1
    out = []
    for i, d in enumerate(described):
        free = d["free"] // shared[d["host"]] if d["kind"] == "cpu" and not d["mem"] else d["free"]
        m = margin[i] if isinstance(margin, list) else margin
        m = default_margin(d["total"]) if m is None else int(m)
        d["room"], d["margin"], d["share"] = max(0, free - m), m, free
        out.append(d["room"])
    return out


def split_layers(path: str, devices: List[DeviceSpec], described: List[dict], n_ctx: int, n_ubatch: int,
                 kv_type: str, overrides, margin, decisions: List[str]) -> List[int]:
    """Layers per device over every rank's devices (placement.ranks decides them within each
    device's room); `described` records each device's projection."""
    from ..placement.ranks import split_over_ranks

    split, rows = split_over_ranks(path, devices, room(described, margin), [d["host"] for d in described], n_ctx,
                                   n_ubatch, kv_type, overrides, decisions)
    for i, r in enumerate(rows):
        described[i]["projected"] = r
    return split


def _given_split(path, specs, described, layer_split, n_ctx, n_ubatch, kv_type, tensor_overrides, margin,
                 n_seq, decisions) -> Tuple[List[int], int]:
    """--layer-split as given: checked against the job's devices, and projected."""
    from ..placement.rules import plan

    split = [int(n) for n in layer_split]
    if len(split) != len(specs):
        raise ValueError(f"--layer-split has {len(split)} entries for the {len(specs)} devices of the MPI "
                         f"job ({', '.join(s.name for s in specs)})")
    decisions.append(f"layers per device as given: {split}")
    room(described, margin)
    if n_ctx is None:
        n_ctx = llm_ctx(path, n_seq)
    for i, r in enumerate(plan(path, devices=specs, layer_split=split, n_ctx=n_ctx, n_ubatch=n_ubatch,
                               kv_type=kv_type, tensor_overrides=tensor_overrides,
                               n_outputs=min(n_ubatch, DEFAULT_N_OUTPUTS))):
        described[i]["projected"] = r
    return split, n_ctx


def setup(job: Job, model: str, devices=None, layer_split: Optional[Sequence[int]] = None,
          tensor_overrides: Optional[Sequence[str]] = None, n_ctx: Optional[int] = None,
          n_ubatch: int = DEFAULT_N_UBATCH, kv_type: str = DEFAULT_KV_TYPE, margin=None, progress: bool = False,
          n_seq: int = 1, choose_ctx: bool = False) -> Setup:
    """Every rank: the model's path here, and (decided on rank 0, the same on every rank) the
    device list of the whole job, the layers of each device and the context (n_ctx None: the
    largest that fits as fit chooses it with choose_ctx, else LLM's default)."""
    path = pull_on_each_host(job, model, progress)
    here = sum(1 for h in job.hosts if h == job.hosts[job.rank])
    mine = agree(job, lambda: describe(parse_devices(devices), here), "cannot use its devices")
    described = []
    specs: List[DeviceSpec] = []
    for r, devs in enumerate(mine):
        for d in devs:
            s = parse_devices(d["spec"])[0]
            specs.append(replace(s, rank=r))
            described.append(dict(d, rank=r, host=job.hosts[r]))
    decisions: List[str] = []
    if job.rank == 0:
        try:
            if layer_split is not None:
                split, n_ctx = _given_split(path, specs, described, layer_split, n_ctx, n_ubatch, kv_type,
                                            tensor_overrides, margin, n_seq, decisions)
            elif n_ctx is None and choose_ctx:
                # (the last split that fitted is the chosen context's: `described` holds its projection)
                n_ctx, split = fit_ctx(path, n_seq, lambda c, steps: split_layers(
                    path, specs, described, c, n_ubatch, kv_type, tensor_overrides, margin, steps), decisions)
            else:
                n_ctx = llm_ctx(path, n_seq) if n_ctx is None else n_ctx
                split = split_layers(path, specs, described, n_ctx, n_ubatch, kv_type, tensor_overrides, margin,
                                     decisions)
            decided = (True, split, decisions, n_ctx)
        except Exception as e:  # noqa: BLE001 - every rank stops with it
            decided = (False, f"{type(e).__name__}: {e}", [])
    else:
        decided = None
    decided = job.comm.bcast(decided, root=0)
    if not decided[0]:
        raise RuntimeError(f"{job.who(0)}: {decided[1]}")
    return Setup(path, specs, decided[1], decided[3], list(tensor_overrides) if tensor_overrides else None,
                 described, decided[2])


def serve_here(job: Job, s: Setup) -> int:
    """Ranks other than 0: load this rank's share and repeat rank 0's calls until it ends the job."""
    from ..engine import Model

    model, error = None, ""
    try:
        model = Model(s.path, devices=s.devices, layer_split=s.layer_split, tensor_overrides=s.tensor_overrides)
    except Exception as e:  # noqa: BLE001 - rank 0 is told, and raises it
        error = f"{type(e).__name__}: {e}"
    status = _core.engine.serve_ranks(model._m if model is not None else None, error)
    return 1 if error else status


def start(model, devices=None, layer_split: Optional[Sequence[int]] = None,
          tensor_overrides: Optional[Sequence[str]] = None, **kw) -> Tuple[List[DeviceSpec], List[int]]:
    """Call on every rank of the job. Ranks other than 0 load their share and serve rank 0 until
    it calls finish(), then exit the process; rank 0 gets the job's device list and layer split,
    to make its stowlm.Model / stowlm.LLM with (and must call finish() at the end)."""
    jobs.take_over()
    job = jobs.init()
    s = setup(job, model, devices, layer_split, tensor_overrides, **kw)
    if job.rank != 0:
        status = serve_here(job, s)
        sys.stdout.flush()
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.Finalize()
        os._exit(status)  # nothing of rank 0's script runs here
    return s.devices, s.layer_split
