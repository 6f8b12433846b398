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
'stowlm[mpi]'`` (mpi4py and Open MPI from the package index).

This module is the public face of stowlm.dist, where the job library lives."""
from .dist import INSTALL, Job, Setup, fatal, finish, init, launched, launched_size, serve_here, setup, start

__all__ = ["INSTALL", "Job", "Setup", "fatal", "finish", "init", "launched", "launched_size", "serve_here", "setup",
           "start"]
