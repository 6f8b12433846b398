#!/usr/bin/env python3
"""The big mixture-of-experts comparison of issue 26 on a GPU machine: a Qwen3-30B-A3B-shaped
model with random weights (../shared/tools/make_big_moe.py, ~17.5 GB, for speed only) stowed on a
GPU held to --mem (default 8 GiB) plus the CPU as fit decides, against llama.cpp's CUDA build with
the same number of layers on the GPU and the same layers' experts on the CPU (-ngl, -ot ...=CPU).
bench/gpu_compare.py alternates the two (pp512 and tg128 over --rounds), with one more stowlm row
whose prompts leave the experts to the CPU (--moe-offload-min 0): what copying them to the GPU
brings, for the threshold's default; and two whose host computes a share of each staged layer's
experts itself while the GPU copies in the rest (STOWLM_MOE_CPU_SHARE=0.25 and 0.35: a prompt is
bound by the bus there, and the host's cores wait). --old-variants runs the rows of the first
measurement instead: staged experts copied from unpinned pages (STOWLM_PIN_EXPERTS=0) and the CPU's
weights in GGUF's layout (STOWLM_REPACK=0).

    python3 bench/big_moe_compare.py [--model PATH] [--mem 8GiB] [--rounds 2] [--out DIR]
                                     [--devices LIST] [--dry-run] [--no-variants] [--old-variants] [--no-sweep] [-- gpu_compare options ...]

--model: the GGUF (default: big-moe.gguf in the stowlm cache, written by make_big_moe.py from
smollm2-135m when missing; the tools come from $STOWLM_SHARED/tools or ../shared/tools).
--devices: the devices fit places on (default 'cuda:0[mem=MEM],cpu'). --dry-run prints the
placement and both tools' arguments without running them (--devices 'cpu:1[mem=...],cpu:0' tries
it on a machine without a GPU: tests/test_gpu_compare.py).
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_compare  # noqa: E402
from carry_models import resolve_model  # noqa: E402


def shared_tools() -> Path:
    shared = os.environ.get("STOWLM_SHARED")
    return Path(shared) / "tools" if shared else REPO.parent / "shared" / "tools"


def make_model(out: Path) -> None:
    """Writes the big model with make_big_moe.py (tokenizer from smollm2-135m)."""
    tool = shared_tools() / "make_big_moe.py"
    if not tool.is_file():
        raise SystemExit(f"big_moe_compare: {out} is missing and so is {tool} to write it")
    smol = resolve_model("smollm2-135m")
    if not smol.is_file():
        raise SystemExit(f"big_moe_compare: make_big_moe.py needs smollm2-135m ({smol})")
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(tool), str(smol), str(out)]
    print("+ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    subprocess.run(cmd, check=True)


def tool_args(placement) -> Tuple[List[str], List[str]]:
    """stowlm-bench's and llama-bench's placement arguments for a fitted layer placement: the same
    devices, layers per device, layer ranges (interleave) and overrides for stowlm; for llama.cpp the GPU's layer count
    (-ngl) and the overrides that send weights to a CPU device as one -ot 'REGEX=CPU;REGEX=CPU'."""
    if placement.split_mode != "layer":
        raise ValueError("big_moe_compare: a layer placement is needed, fit made a tensor split")
    used = placement.used_devices
    specs = [d.spec for d in used]
    ours = ["-dev", ",".join(specs), "--layer-split", ",".join(str(d.n_layers) for d in used),
            "--interleave", str(placement.interleave)]
    theirs = ["-ngl", str(sum(d.n_layers for d in used if not d.name.startswith("cpu"))), "-fa", "1"]
    to_cpu = []
    for o in placement.tensor_overrides:
        rx, _, dev = o.rpartition("=")
        ours += ["-ot", o]
        if dev.startswith("cpu"):
            to_cpu.append(f"{rx}=CPU")
    if to_cpu:  # one -ot, ';' between overrides: llama-bench runs each -ot given as a test of its own
        theirs += ["-ot", ";".join(to_cpu)]
    return ours, theirs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="the big MoE GGUF (default: big-moe.gguf in the stowlm cache)")
    ap.add_argument("--mem", default="8GiB", help="the GPU's budget (default 8GiB)")
    ap.add_argument("--devices", default=None, help="what fit places on (default 'cuda:0[mem=MEM],cpu')")
    ap.add_argument("-c", "--ctx", type=int, default=4096, help="the context fit keeps (default 4096)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--stowlm", default=None, help="stowlm-bench binary (default: build/, the package, PATH)")
    ap.add_argument("--dry-run", action="store_true", help="print the placement and the arguments only")
    ap.add_argument("--variants", action=argparse.BooleanOptionalAction, default=True,
                    help="the rows with the host computing a share of the staged experts (default on)")
    ap.add_argument("--old-variants", action="store_true",
                    help="the unpinned and GGUF-layout rows instead of the host's shares")
    ap.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True,
                    help="then prompt speed by micro-batch with the experts' products on the GPU and on the CPU, "
                         "and one run with each device's ops timed (default on)")
    a, rest = ap.parse_known_args(argv)
    if rest and rest[0] == "--":
        rest = rest[1:]
    model = Path(a.model) if a.model else resolve_model("big-moe")
    if not model.is_file():
        make_model(model)
    from stowlm.fit import fit

    devices = a.devices or f"cuda:0[mem={a.mem}],cpu"
    placement = fit(str(model), devices, n_ctx=a.ctx)
    print(f"[{placement.summary()}]", flush=True)
    ours, theirs = tool_args(placement)
    print("stowlm-bench " + " ".join(shlex.quote(x) for x in ours), flush=True)
    print("llama-bench " + " ".join(shlex.quote(x) for x in theirs), flush=True)
    if a.dry_run:
        return 0
    args = ["-m", str(model), "--rounds", str(a.rounds), "--no-graphs-off",
            "--stowlm-args=" + shlex.join(ours), "--peer-args=" + shlex.join(theirs),
            "--variant", "experts on the CPU for prompts=--moe-offload-min 0"]
    if a.variants and a.old_variants:
        args += ["--variant", "staged experts not pinned=STOWLM_PIN_EXPERTS=0",
                 "--variant", "experts in GGUF's layout=STOWLM_REPACK=0"]
    elif a.variants:
        args += ["--variant", "host computes 25% of staged experts=STOWLM_MOE_CPU_SHARE=0.25",
                 "--variant", "host computes 35% of staged experts=STOWLM_MOE_CPU_SHARE=0.35"]
    if a.out:
        args += ["--out", a.out]
    if a.stowlm:
        args += ["--stowlm", a.stowlm]
    rc = gpu_compare.main(args + rest)
    if a.sweep:
        sweep(gpu_compare.find_stowlm_bench(a.stowlm), model, ours)
    return rc


def sweep(exe: str, model: Path, placement_args: List[str]) -> None:
    """What moe_offload_min's default rests on: prompt speed by micro-batch size with the staged
    experts' products on the GPU (--moe-offload-min 1) and on the CPU (0); then one run with
    CUDA graphs off and -v, each device's ops timed (where a token's time goes)."""
    sizes = "16,32,64,128,256,512"
    speeds = {}
    for label, knob in (("GPU", "1"), ("CPU", "0")):
        cmd = [exe, "-m", str(model)] + placement_args + ["--moe-offload-min", knob, "-p", sizes, "-n", "0", "-r", "2",
                                                          "-o", "json"]
        try:
            rows, _ = gpu_compare.run_tool(cmd, None, 600)
        except gpu_compare.ToolError as e:
            print(f"big_moe_compare: sweep: {e}", flush=True)
            return
        speeds[label] = {r["test"]: r["avg_ts"] for r in rows}
    print("\n| micro-batch | experts' products on the GPU (t/s) | on the CPU (t/s) | GPU/CPU |\n| ---: | ---: | ---: | ---: |")
    for t in speeds["GPU"]:
        g, c = speeds["GPU"][t], speeds["CPU"].get(t)
        print(f"| {t} | {g:.1f} | {c:.1f} | {g / c:.2f} |" if c else f"| {t} | {g:.1f} | - | - |")
    cmd = [exe, "-m", str(model)] + placement_args + ["-p", "512", "-n", "32", "-r", "1", "-o", "json", "-v"]
    print("(STOWLM_CUDA_GRAPHS=0)", flush=True)
    try:
        _, err = gpu_compare.run_tool(cmd, dict(os.environ, STOWLM_CUDA_GRAPHS="0"), 600)
    except gpu_compare.ToolError as e:
        print(f"big_moe_compare: sweep: {e}", flush=True)
        return
    print(err, flush=True)


if __name__ == "__main__":
    sys.exit(main())
