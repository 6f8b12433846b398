"""One `stowlm ...` in one process: the arguments parsed, the command run, its errors turned into
a message and an exit status (2: the model does not fit, 130: interrupted, 1: any other error)."""
from __future__ import annotations

import argparse
import sys
from typing import List

from .args import parser, resolve_model
from .commands import embed, fit, run, serve
from .tools import bench, info, pull_command

COMMANDS = {"run": run, "pull": pull_command, "info": info, "bench": bench, "fit": fit, "serve": serve,
            "embed": embed}


def run_argv(argv: List[str]) -> int:
    p = parser()
    if argv[:1] == ["bench"]:
        # argparse's REMAINDER refuses a first argument that looks like an option ("-m"):
        # everything after "bench" belongs to stowlm-bench.
        a = argparse.Namespace(command="bench", args=list(argv[1:]))
    else:
        a = p.parse_args(argv)
        resolve_model(a, p)
    if a.command is None:
        p.print_help()
        return 0
    try:
        return COMMANDS[a.command](a)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except MemoryError as e:
        from ..fit import FitError

        print(f"stowlm: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, FitError) else 1
    except (ValueError, FileNotFoundError, MemoryError, RuntimeError, OSError) as e:
        print(f"stowlm: error: {e}", file=sys.stderr)
        return 1
