"""`stowlm ...` on every rank of an MPI job: run, serve and fit over the ranks (stowlm.dist sets
the job up), any other command on rank 0 alone."""
from __future__ import annotations

import sys
from typing import List

from ..dist import job as jobs
from ..dist.report import explain, table
from ..dist.stages import serve_here, setup
from ..placement.rules import DEFAULT_KV_TYPE, DEFAULT_N_UBATCH, slot_context
from .app import run_argv
from .args import kv_type_of, margins_mib, number_list, parser, resolve_model
from .commands import run, serve


def main(argv: List[str]) -> int:
    """Every rank: joins the job and does its part of the command; the job ends with its status."""
    jobs.take_over()
    try:
        job = jobs.init()
    except RuntimeError as e:
        print(f"stowlm: error: {e}", file=sys.stderr)
        return 1
    if argv[:1] == ["bench"]:
        if job.rank == 0:
            print("stowlm: under mpirun, measure with `python bench/mpi_bench.py` (the native stowlm-bench runs "
                  "in one process)", file=sys.stderr)
        return 2
    p = parser()
    a = p.parse_args(argv)
    resolve_model(a, p)  # -m MODEL, or the default model, as one process takes them
    if a.command not in ("run", "serve", "fit"):
        return run_argv(argv) if job.rank == 0 else 0  # one rank does it
    status = 1
    try:
        status = command(job, a)
    except KeyboardInterrupt:
        status = 130
    except Exception as e:  # noqa: BLE001 - every error ends the job with its reason
        print(f"stowlm: error on {job.who()}: {e}", file=sys.stderr)
        status = 2 if type(e).__name__ == "FitError" else 1
    finally:
        jobs.finish(status)
    return status


def command(job: jobs.Job, a) -> int:
    """run / serve / fit of the parsed arguments `a` on this rank of `job`."""
    if getattr(a, "placement", None):
        raise ValueError("--placement is not supported under mpirun yet: give --devices (each rank its own) and "
                         "--layer-split (every device of the job) or let the ranks split the layers")
    if getattr(a, "n_gpu_layers", None) is not None:
        raise ValueError("-ngl is not supported under mpirun: give --devices (each rank its own)")
    a.kv_type = kv_type_of(a)  # -ctk / -ctv too
    if a.split_mode not in (None, "layer"):
        raise ValueError(f"-sm {a.split_mode} cuts every layer over the devices of one process; under mpirun the "
                         "ranks split the layers")
    if getattr(a, "threads", None) and not a.devices:
        a.devices = f"cpu:0[threads={a.threads}]"
    n_seq = a.parallel if a.command == "serve" else 1
    n_ctx = a.ctx_size  # (with slots, each gets n_ctx / n_seq; the split is projected with what the context makes)
    if n_ctx is not None:
        n_ctx = slot_context(n_ctx, n_seq)
    split = number_list(a.layer_split, "--layer-split", int, "integers")
    s = setup(job, a.model, a.devices, split, a.override_tensor, n_ctx=n_ctx,
              n_ubatch=a.ubatch_size or DEFAULT_N_UBATCH, kv_type=a.kv_type or DEFAULT_KV_TYPE,
              margin=margins_mib(a.fit_margin), n_seq=n_seq, choose_ctx=True,
              progress=not getattr(a, "quiet", False) and not getattr(a, "json", False))
    if a.command == "fit":
        if job.rank == 0:
            print(table(s))
            if a.explain:
                print("decisions:")
                for line in explain(s):
                    print(f"- {line}")
        return 0
    if job.rank != 0:
        return serve_here(job, s)
    a.model = s.path
    a.devices = ",".join(str(d) for d in s.devices)
    a.layer_split = ",".join(str(n) for n in s.layer_split)
    a.ctx_size = s.n_ctx  # the context the split was projected with
    a.threads, a.no_fit = None, True
    return run(a) if a.command == "run" else serve(a)
