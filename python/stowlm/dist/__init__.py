"""Several machines: pipeline stages on MPI ranks (the library; ``stowlm.mpi`` is its public face
and docs/several-machines.md its guide).

    job.py      joining the job, agreeing across ranks, ending the job
    context.py  the context every rank makes
    stages.py   every rank's devices and room, the layers of each device, a rank serving its share
    report.py   the table and the reasons of a job's setup

Nothing here imports the command line: the CLI's MPI entry (stowlm.cli.mpi_entry) calls this.
"""
from .job import INSTALL, Job, fatal, finish, init, launched, launched_size
from .report import explain, table
from .stages import Setup, serve_here, setup, start

__all__ = ["INSTALL", "Job", "Setup", "explain", "fatal", "finish", "init", "launched", "launched_size",
           "serve_here", "setup", "start", "table"]
