#!/usr/bin/env python3
"""Compare stowlm-bench with llama-bench (or any peer speaking llama-bench's flags and JSON).

    python bench/compare.py --peer /path/to/llama-bench -m model.gguf [-m other.gguf]
                            [-p 512] [-n 128] [-d 0,4096] [-t 2] [-r 3] [--rounds 1]

For every model and test (ppP and tgN at each depth) it runs stowlm-bench, then each peer, on
the same model with the same settings, one test per call, alternating so that a machine whose
speed drifts treats both alike. Samples of all rounds are pooled. Prints one markdown table:
tokens/s (mean ± std) per tool and the ratio stowlm / peer per test. --json FILE keeps the raw
results of every call.

A peer given as LABEL=PATH is named LABEL in the table. --peer-args (default "-fa 1") are
appended to every peer call, e.g. to turn flash attention on in llama-bench. --peer-depth gp
asks a peer for generation at depth as ik_llama.cpp's llama-bench spells it (`-gp D,N`: N
tokens timed after a prompt of D), where llama.cpp's says `-d D`. --best reports each tool's
best round (the mean of that round's repetitions) instead of all samples pooled.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parent.parent


def find_stowlm_bench(given: Optional[str]) -> str:
    if given:
        return given
    for c in (REPO / "build" / "stowlm-bench",):
        if c.is_file():
            return str(c)
    try:
        import stowlm

        c = Path(stowlm.__file__).resolve().parent / "bin" / "stowlm-bench"
        if c.is_file():
            return str(c)
    except ImportError:
        pass
    found = shutil.which("stowlm-bench")
    if not found:
        sys.exit("compare.py: stowlm-bench not found (build it, pip install the package, or pass --stowlm PATH)")
    return found


def int_list(text: str) -> List[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if any(x < 0 for x in out):
        raise argparse.ArgumentTypeError(f"values must be >= 0, got {text!r}")
    return out


def run_json(cmd: List[str]) -> List[dict]:
    print("+ " + " ".join(shlex.quote(c) for c in cmd), file=sys.stderr, flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"compare.py: command failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-4000:]}")
    # llama-bench may print log lines before the JSON array on stdout
    start = r.stdout.find("[")
    if start < 0:
        sys.exit(f"compare.py: no JSON in the output of {' '.join(cmd)}:\n{r.stdout[-2000:]}")
    return json.loads(r.stdout[start:])


def stats(samples: List[float]) -> Tuple[float, float]:
    m = sum(samples) / len(samples)
    sd = math.sqrt(sum((x - m) ** 2 for x in samples) / (len(samples) - 1)) if len(samples) > 1 else 0.0
    return m, sd


def test_name(n_prompt: int, n_gen: int, depth: int) -> str:
    s = f"pp{n_prompt}" if n_prompt else f"tg{n_gen}"
    return s + (f" @ d{depth}" if depth else "")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", action="append", required=True, metavar="[LABEL=]PATH",
                    help="a llama-bench binary (repeatable)")
    ap.add_argument("--peer-args", default="-fa 1", help="extra arguments for every peer call (default '-fa 1')")
    ap.add_argument("--stowlm", default=None, help="stowlm-bench binary (default: build/, the package, PATH)")
    ap.add_argument("-m", "--model", action="append", required=True, help="GGUF model (repeatable)")
    ap.add_argument("-p", "--n-prompt", type=int_list, default=[512])
    ap.add_argument("-n", "--n-gen", type=int_list, default=[128])
    ap.add_argument("-d", "--n-depth", type=int_list, default=[0])
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="times to alternate over all tests (samples pooled)")
    ap.add_argument("--json", default=None, metavar="FILE", help="write every call's raw results here")
    ap.add_argument("--peer-depth", choices=["d", "gp"], default="d",
                    help="how peers are asked for depth: -d D (llama.cpp) or -gp D,N (ik_llama.cpp; tg only)")
    ap.add_argument("--best", action="store_true", help="report each tool's best round, not all samples pooled")
    a = ap.parse_args(argv)

    stowlm_exe = find_stowlm_bench(a.stowlm)
    peers: List[Tuple[str, str]] = []
    for spec in a.peer:
        label, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            sys.exit(f"compare.py: peer {path!r} is not an executable file")
        peers.append((label or (Path(path).name if len(a.peer) == 1 else str(Path(path).parent)), path))
    for m in a.model:
        if not os.path.isfile(m):
            sys.exit(f"compare.py: model file {m!r} does not exist")
    if a.repetitions < 1 or a.rounds < 1 or a.threads < 1:
        sys.exit("compare.py: -r, --rounds and -t must be >= 1")

    tests = [(p, 0, d) for d in a.n_depth for p in a.n_prompt if p > 0]
    tests += [(0, n, d) for d in a.n_depth for n in a.n_gen if n > 0]
    if not tests:
        sys.exit("compare.py: nothing to run (every -p and -n is 0)")

    tools = [("stowlm", stowlm_exe, [])] + [(label, path, shlex.split(a.peer_args)) for label, path in peers]
    samples: Dict[Tuple[str, str, str], List[float]] = {}
    rounds: Dict[Tuple[str, str, str], List[float]] = {}  # the mean of each round's call
    raw: List[dict] = []
    info: Dict[str, dict] = {}
    for _ in range(a.rounds):
        for model in a.model:
            for p, n, d in tests:
                name = test_name(p, n, d)
                for label, exe, extra in tools:
                    # no -d at depth 0: ik_llama.cpp's llama-bench refuses the flag, every tool's default is 0
                    cmd = [exe, "-m", model, "-p", str(p), "-n", str(n)] + (["-d", str(d)] if d else [])
                    if label != "stowlm" and a.peer_depth == "gp":  # that llama-bench knows no -d
                        if d and p:
                            continue  # -gp times generation only
                        cmd = [exe, "-m", model] + (["-p", "0", "-n", "0", "-gp", f"{d},{n}"] if d else ["-p", str(p), "-n", str(n)])
                    cmd += ["-t", str(a.threads), "-r", str(a.repetitions), "-o", "json"] + extra
                    for res in run_json(cmd):
                        ts = [float(x) for x in res["samples_ts"]]
                        samples.setdefault((model, name, label), []).extend(ts)
                        rounds.setdefault((model, name, label), []).append(sum(ts) / len(ts))
                        info.setdefault(label, res)
                        raw.append(dict(tool=label, command=cmd, **res))
                    if a.json:  # after every call: a long comparison cut short keeps what it measured
                        with open(a.json, "w") as f:
                            json.dump(raw, f, indent=1)

    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cpu = info.get("stowlm", {}).get("cpu_info", platform.processor())
    print(f"{today}; {cpu}; {a.threads} threads; {a.repetitions} repetitions x {a.rounds} round(s); "
          f"peer args: {a.peer_args!r}" + ("; best round of each" if a.best else ""))
    for label, _ in peers:
        i = info.get(label, {})
        print(f"{label}: build {i.get('build_commit', '?')} ({i.get('build_number', '?')})")
    print()
    head = ["model", "test", "stowlm t/s"]
    for label, _ in peers:
        head += [f"{label} t/s", f"stowlm/{label}"]
    print("| " + " | ".join(head) + " |")
    print("| " + " | ".join(["---", "---"] + ["---:"] * (len(head) - 2)) + " |")
    for model in a.model:
        for p, n, d in tests:
            name = test_name(p, n, d)
            def figure(label: str) -> Optional[Tuple[float, str]]:
                if a.best:
                    r = rounds.get((model, name, label))
                    return (max(r), f"{max(r):.2f}") if r else None
                got = samples.get((model, name, label))
                if not got:
                    return None
                m, sd = stats(got)
                return m, f"{m:.2f} ± {sd:.2f}"

            ours = figure("stowlm")
            if not ours:
                continue
            row = [Path(model).stem, name, ours[1]]
            for label, _ in peers:
                theirs = figure(label)
                row += [theirs[1], f"{ours[0] / theirs[0]:.2f}"] if theirs else ["-", "-"]
            print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
