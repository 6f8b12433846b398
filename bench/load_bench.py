#!/usr/bin/env python3
"""How long `stowlm.LLM(model)` takes to construct (issue 29: a model file is opened and parsed
once per load), each round in a fresh process so nothing is cached in Python; the file's pages
are warm after the first round (what a user reloading a model sees).

    python bench/load_bench.py -m smollm2-135m --rounds 7
    python bench/load_bench.py -m smollm2-135m --python /path/to/other/checkout/python

Prints the median and best seconds of `import stowlm` and of the construction, and peak RSS.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import stowlm
t1 = time.perf_counter()
llm = stowlm.LLM(sys.argv[1], n_ctx=int(sys.argv[2]))
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "stowlm": stowlm.__file__}))
"""


def resolve(model: str) -> str:
    if os.path.isfile(model):
        return model
    sys.path.insert(0, str(REPO / "python"))
    from stowlm.pull import pull

    return str(pull(model))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True, help="GGUF file or a name from `stowlm pull`")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--python", default=str(REPO / "python"), help="the stowlm to measure (a python/ folder)")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        sys.exit("load_bench.py: --rounds must be >= 1")
    model = resolve(a.model)
    env = dict(os.environ, PYTHONPATH=a.python)
    runs = []
    for _ in range(a.rounds):
        r = subprocess.run([sys.executable, "-c", CHILD, model, str(a.n_ctx)], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"load_bench.py: the child failed:\n{r.stderr[-3000:]}")
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    imp = [x["import_s"] for x in runs]
    load = [x["load_s"] for x in runs]
    print(f"{Path(model).name} ({runs[0]['stowlm']}), n_ctx {a.n_ctx}, {a.rounds} fresh processes:")
    print(f"  import stowlm   median {statistics.median(imp) * 1e3:.1f} ms, best {min(imp) * 1e3:.1f} ms")
    print(f"  LLM(model)      median {statistics.median(load) * 1e3:.1f} ms, best {min(load) * 1e3:.1f} ms")
    print(f"  peak RSS        {max(x['rss_mib'] for x in runs):.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
