"""The commands about model files and the native benchmark: pull, info, bench."""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess

from ..placement.data import format_size


def pull_command(a: argparse.Namespace) -> int:
    from .. import pull

    if a.list or not a.name:
        for m in pull.list_models():
            state = m["path"] or "not downloaded"
            print(f"{m['name']:<22} {m['size'] / 1e6:7.1f} MB  {m['description']}  [{state}]")
        return 0
    path = pull.pull(a.name, verify=a.verify)
    print(path)
    return 0


def info(a: argparse.Namespace) -> int:
    from .. import pull
    from ..engine import plan
    from ..gguffile import GGUFFile

    path = pull.resolve(a.model, download=False)
    with GGUFFile(path) as f:
        meta = f.metadata
        tensors = f.tensors
    arch = meta.get("general.architecture", "?")
    print(f"file:          {path}")
    print(f"architecture:  {arch}")
    print(f"name:          {meta.get('general.name', '')}")
    total = sum(t[3] for t in tensors)
    n_params = 0
    for t in tensors:
        n = 1
        for d in t[2]:
            n *= int(d)
        n_params += n
    print(f"tensors:       {len(tensors)}, {format_size(total)}, {n_params / 1e6:.1f} M parameters")
    print("metadata:")
    for k in sorted(meta):
        if k.startswith("tokenizer.ggml.") or k == "tokenizer.chat_template":
            v = meta[k]
            desc = f"<{len(v)} entries>" if hasattr(v, "__len__") and not isinstance(v, str) else \
                f"<{len(v)} chars>" if isinstance(v, str) and len(v) > 60 else repr(v)
            print(f"  {k:<42} {desc}")
            continue
        print(f"  {k:<42} {meta[k]!r}")
    by_type: dict = {}
    for t in tensors:
        c = by_type.setdefault(t[1], [0, 0])
        c[0] += 1
        c[1] += t[3]
    print("tensor types:")
    for name, (count, nbytes) in sorted(by_type.items(), key=lambda kv: -kv[1][1]):
        print(f"  {name:<8} {count:5d} tensors  {format_size(nbytes)}")
    if a.tensors:
        for t in tensors:
            print(f"  {t[0]:<40} {t[1]:<8} {str(tuple(t[2])):<20} {format_size(t[3])}")
    try:
        rows = plan(path, n_ctx=a.ctx_size)
        print(f"memory on each device (n_ctx={a.ctx_size}):")
        for r in rows:
            print(f"  {r['device']:<10} weights {format_size(r['weights'])}, KV {format_size(r['kv'])}, "
                  f"compute {format_size(r['compute'])}, total {format_size(r['total'])}")
    except ValueError as e:  # e.g. an architecture the engine does not know
        print(f"memory projection unavailable: {e}")
    return 0


def bench(a: argparse.Namespace) -> int:
    if "--spec" in a.args or any(x.startswith("--spec=") for x in a.args):
        from ..specbench import main  # speculation is decided in Python: measured there

        return main(a.args)
    # stowlm-bench is installed beside the package (stowlm/bin), one folder above this one
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bin", "stowlm-bench")
    exe = here if os.path.exists(here) else shutil.which("stowlm-bench")
    if exe is None:
        raise FileNotFoundError("stowlm-bench is not installed with this package")
    return subprocess.call([exe] + list(a.args))
