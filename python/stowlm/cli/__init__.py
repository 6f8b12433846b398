"""The `stowlm` command line: run, serve, fit, pull, info, bench.

    args.py       the parser and the settings its flags make
    commands.py   run, serve, fit (the commands that load a model)
    tools.py      pull, info, bench
    app.py        one command in one process: parse, run, exit status
    mpi_entry.py  the same under mpirun, every rank taking its part (stowlm.dist sets the job up)
"""
from __future__ import annotations

import sys
from typing import List, Optional

from .args import DEFAULT_MODEL

__all__ = ["main", "DEFAULT_MODEL"]


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from ..dist.job import launched

    if launched():  # under mpirun every rank takes its part (stowlm/cli/mpi_entry.py)
        from .mpi_entry import main as on_every_rank

        return on_every_rank(argv)
    from .app import run_argv

    return run_argv(argv)
