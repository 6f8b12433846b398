#!/usr/bin/env python3
"""stowlm-bench against llama.cpp's llama-bench on the same GPU (issue 26): pp512 and tg128.

    python3 bench/gpu_compare.py [-m NAME|PATH ...] [--device cuda|cpu] [--rounds 3] [-r 3]
                                 [--peer PATH | --peer-tar TAR] [--out DIR]

For each round and model it runs stowlm-bench (every layer on cuda:0) and then llama-bench
(`-ngl 99 -fa 1`), both with `-p 512 -n 128 -r 3 -o json`, so the two alternate and a drift of
the machine treats both alike. It prints every call's figures, the median of each tool's
samples over the rounds and the ratio stowlm / llama.cpp, writes gpu_compare.md and
gpu_compare.json to --out (default $OUT, else ./gpu_compare_out), and with --kernel-report (on
for cuda) one `stowlm-bench -v` run per model for its kernels per token, its host launches (CUDA
graphs and kernels) and time outside them. With --graphs-off (on for cuda) each round also runs
stowlm-bench with STOWLM_CUDA_GRAPHS=0: its own column, what the graphs bring.

The peer is llama.cpp's CUDA build from ../shared/peers/llama.cpp-cuda-sm90.tar.xz (unpacked
into a temporary folder) or a given llama-bench. Its CUDA backend needs cuBLAS
(libcublas.so.13): found through `ldconfig -p`, the Python packages' nvidia/*/lib folders or a
CUDA toolkit's lib64, and put on LD_LIBRARY_PATH; without it the peer is marked unavailable
(llama.cpp would quietly run on the CPU instead, so a peer result not on CUDA is refused too).

--device cpu runs stowlm-bench on the CPU and llama-bench with `-ngl 0 -dev none`: the same
alternation and parsing on a machine without a GPU. Models given by name are looked up in
the stowlm cache (~/.cache/stowlm/models or $STOWLM_CACHE/models); a missing one is skipped
with a message.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import re
import shlex
import shutil
import site
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from carry_models import PEER_TAR, resolve_model  # noqa: E402  (the carried peer's name, the cache's models)
from compare import find_stowlm_bench, test_name  # noqa: E402  (bench/compare.py: the same lookup and names)

DEFAULT_MODELS = ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen3moe-tiny"]


class ToolError(RuntimeError):
    """A tool's call failed or printed nothing this script can read."""


# ---- parsing the two tools' outputs ------------------------------------------------------------

_TEST = re.compile(r"^(?:pp(\d+))?(?:\+?tg(\d+))?(?: @ d(\d+))?$")


def split_test_name(name: str) -> Tuple[int, int, int]:
    """'pp512' -> (512, 0, 0), 'tg128 @ d4096' -> (0, 128, 4096), 'pp512+tg128' -> (512, 128, 0)."""
    m = _TEST.match(name.strip())
    if not m or not (m.group(1) or m.group(2)):
        raise ToolError(f"cannot read the test name {name!r}")
    return int(m.group(1) or 0), int(m.group(2) or 0), int(m.group(3) or 0)


def _record(n_prompt: int, n_gen: int, n_depth: int, samples: List[float], raw: dict) -> dict:
    name = test_name(n_prompt, n_gen, n_depth)
    if n_prompt and n_gen:  # -pg: compare.py's names know pp or tg alone
        name = f"pp{n_prompt}+" + test_name(0, n_gen, n_depth)
    return dict(test=name, n_prompt=n_prompt, n_gen=n_gen, n_depth=n_depth, samples_ts=samples,
                avg_ts=sum(samples) / len(samples), backends=raw.get("backends", ""), raw=raw)


def parse_json_results(text: str) -> List[dict]:
    """llama-bench's / stowlm-bench's `-o json` array (log lines before it are skipped)."""
    starts = [m.start() for m in re.finditer(r"^\s*\[", text, re.M)]
    for start in starts:
        try:
            data = json.loads(text[start:])
        except json.JSONDecodeError:
            continue
        if not isinstance(data, list):
            continue
        out = []
        for r in data:
            samples = [float(x) for x in r.get("samples_ts") or [r["avg_ts"]]]
            out.append(_record(int(r["n_prompt"]), int(r["n_gen"]), int(r.get("n_depth", 0)), samples, r))
        return out
    raise ToolError("no JSON array in the output")


def parse_markdown_results(text: str) -> List[dict]:
    """The markdown table both tools print by default: one record per row, the mean only."""
    rows = [ln for ln in text.splitlines() if ln.strip().startswith("|")]
    if len(rows) < 3:
        raise ToolError("no markdown table in the output")
    head = [c.strip() for c in rows[0].strip().strip("|").split("|")]
    if "test" not in head or "t/s" not in head:
        raise ToolError(f"the table has no test and t/s columns: {head}")
    i_test, i_ts = head.index("test"), head.index("t/s")
    i_backend = head.index("backend") if "backend" in head else None
    out = []
    for ln in rows[2:]:
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        if len(cells) != len(head):
            raise ToolError(f"a table row has {len(cells)} cells for {len(head)} columns: {ln!r}")
        mean = float(cells[i_ts].split("±")[0])
        raw = {"backends": cells[i_backend]} if i_backend is not None else {}
        out.append(_record(*split_test_name(cells[i_test]), [mean], raw))
    return out


def parse_results(text: str) -> List[dict]:
    """JSON if the output has it, else the markdown table."""
    try:
        return parse_json_results(text)
    except ToolError:
        return parse_markdown_results(text)


def parse_kernel_report(stderr: str) -> List[str]:
    """stowlm-bench -v's lines on kernels per token (CUDA devices)."""
    return [ln.strip() for ln in stderr.splitlines() if " kernels per " in ln or "timed splits waited" in ln]


def median(xs: List[float]) -> float:
    return statistics.median(xs)


# ---- finding things ----------------------------------------------------------------------------

def find_cublas() -> Tuple[Optional[str], str]:
    """(folder to add to LD_LIBRARY_PATH or "" when the loader already finds it, None when
    missing; what was looked at)."""
    looked = []
    try:
        listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        listing = ""
    looked.append("ldconfig -p")
    if re.search(r"libcublas\.so\.13\b", listing) and re.search(r"libcublasLt\.so\.13\b", listing):
        return "", "ldconfig -p"
    roots = []
    try:
        roots += site.getsitepackages()
    except AttributeError:  # some virtualenvs' site module
        pass
    roots += [site.getusersitepackages()] + [p for p in sys.path if p.endswith("-packages")]
    patterns = []
    for r in dict.fromkeys(roots):
        patterns += [os.path.join(r, "nvidia", "cublas", "lib"), os.path.join(r, "nvidia", "*", "lib")]
    patterns += ["/usr/local/cuda/lib64", "/usr/local/cuda-*/lib64", "/usr/local/cuda-*/targets/x86_64-linux/lib"]
    for pat in patterns:
        looked.append(pat)
        for d in sorted(glob.glob(pat)):
            if os.path.exists(os.path.join(d, "libcublas.so.13")) and os.path.exists(os.path.join(d, "libcublasLt.so.13")):
                return d, ", ".join(looked)
    return None, ", ".join(looked)


def default_peer_tar() -> Optional[Path]:
    """The prebuilt peer: carried into .carry/ on a GPU machine, else ../shared/peers."""
    candidates = [REPO / ".carry" / PEER_TAR]
    if "STOWLM_SHARED" in os.environ:
        candidates.append(Path(os.environ["STOWLM_SHARED"]) / "peers" / PEER_TAR)
    candidates.append(REPO.parent / "shared" / "peers" / PEER_TAR)
    return next((c for c in candidates if c.is_file()), None)


def unpack_peer(tar: Path, into: Path) -> Path:
    """llcuda-peer/llama-bench.sh out of the tarball."""
    with tarfile.open(tar) as t:
        members = t.getmembers()
        bad = [m.name for m in members if m.name.startswith("/") or ".." in Path(m.name).parts]
        if bad:
            raise ToolError(f"{tar}: unsafe paths in the archive: {bad[:3]}")
        t.extractall(into)  # noqa: S202 (paths checked above)
    script = into / "llcuda-peer" / "llama-bench.sh"
    if not script.is_file():
        raise ToolError(f"{tar} holds no llcuda-peer/llama-bench.sh")
    return script


def gpu_name() -> str:
    if not shutil.which("nvidia-smi"):
        return ""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError):
        return ""


# ---- running ------------------------------------------------------------------------------------

def run_tool(cmd: List[str], env: Optional[dict], timeout: float) -> Tuple[List[dict], str]:
    """One call: (its results, its stderr). ToolError naming the command when it fails."""
    line = " ".join(shlex.quote(c) for c in cmd)
    print("+ " + line, flush=True)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise ToolError(f"timed out after {timeout:.0f} s: {line}")
    except OSError as e:
        raise ToolError(f"cannot run {line}: {e}")
    if r.returncode != 0:
        raise ToolError(f"exit status {r.returncode}: {line}\n{r.stderr[-3000:]}")
    try:
        return parse_results(r.stdout), r.stderr
    except (ToolError, KeyError, ValueError) as e:
        raise ToolError(f"{e}: {line}\n{r.stdout[-2000:]}")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", action="append", help=f"model name or path (repeatable; default {DEFAULT_MODELS})")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="times the two tools alternate on every model")
    ap.add_argument("-t", "--threads", type=int, default=None, help="CPU threads for both (default: each tool's own)")
    ap.add_argument("--stowlm", default=None, help="stowlm-bench binary (default: build/, the package, PATH)")
    ap.add_argument("--peer", default=None, help="llama-bench or llama-bench.sh to use instead of the tarball")
    ap.add_argument("--peer-tar", default=None, help=f"the prebuilt peer (default: .carry/ or ../shared/peers/{PEER_TAR})")
    ap.add_argument("--no-peer", action="store_true", help="stowlm-bench alone")
    ap.add_argument("--kernel-report", action=argparse.BooleanOptionalAction, default=None,
                    help="one stowlm-bench -v run per model for kernels per token (default: on for cuda)")
    ap.add_argument("--graphs-off", action=argparse.BooleanOptionalAction, default=None,
                    help="also stowlm-bench with STOWLM_CUDA_GRAPHS=0 in each round (default: on for cuda)")
    ap.add_argument("--stowlm-args", default=None, metavar="ARGS",
                    help="stowlm-bench's placement arguments instead of -dev cuda:0 (e.g. a device list, "
                         "--layer-split and -ot from a fit; write --stowlm-args=..., the value starts with a dash)")
    ap.add_argument("--peer-args", default=None, metavar="ARGS",
                    help="llama-bench's placement arguments instead of -ngl 99 -fa 1 (e.g. -ot ...=CPU)")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=ARGS",
                    help="one more stowlm-bench row per round with these arguments added, in a column of its own; "
                         "leading NAME=VALUE words set its environment as in a shell (repeatable; e.g. 'experts on "
                         "the CPU=--moe-offload-min 0', 'unpinned=STOWLM_PIN_EXPERTS=0')")
    ap.add_argument("--call-timeout", type=float, default=300, help="seconds one tool call may take")
    ap.add_argument("--out", default=None, help="folder for gpu_compare.md/.json (default $OUT, else ./gpu_compare_out)")
    a = ap.parse_args(argv)
    if a.repetitions < 1 or a.rounds < 1 or a.n_prompt < 0 or a.n_gen < 0 or (a.threads is not None and a.threads < 1):
        ap.error("-r, --rounds and -t must be >= 1, -p and -n >= 0")
    if a.n_prompt == 0 and a.n_gen == 0:
        ap.error("nothing to run: -p and -n are both 0")
    out_dir = Path(a.out or os.environ.get("OUT") or "gpu_compare_out")
    out_dir.mkdir(parents=True, exist_ok=True)
    kernel_report = a.device == "cuda" if a.kernel_report is None else a.kernel_report

    models = []
    for spec in a.model or DEFAULT_MODELS:
        path = resolve_model(spec)
        if path.is_file():
            models.append(path)
        else:
            print(f"gpu_compare: model {spec!r} not found at {path}: skipped", flush=True)
    if not models:
        print("gpu_compare: no model to run", file=sys.stderr)
        return 2

    stowlm_exe = find_stowlm_bench(a.stowlm)
    common = ["-p", str(a.n_prompt), "-n", str(a.n_gen), "-r", str(a.repetitions), "-o", "json"]
    if a.threads:
        common += ["-t", str(a.threads)]
    stowlm_args = ["-dev", "cuda:0" if a.device == "cuda" else "cpu"]
    peer_args = ["-ngl", "99", "-fa", "1"] if a.device == "cuda" else ["-ngl", "0", "-dev", "none", "-fa", "1"]
    if a.stowlm_args is not None:
        stowlm_args = shlex.split(a.stowlm_args)
    if a.peer_args is not None:
        peer_args = shlex.split(a.peer_args)
    variants = []
    for v in a.variant:
        label, sep, extra = v.partition("=")
        if not sep or not label.strip() or label.strip() in ("stowlm", "llama.cpp", "stowlm no graphs"):
            ap.error(f"--variant {v!r}: expected LABEL=ARGS with a label of its own")
        words = shlex.split(extra)
        env = {}
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        variants.append((label.strip(), words, dict(os.environ, **env) if env else None))

    # The peer and the libraries it needs.
    peer_exe, peer_env, peer_why = None, None, ""
    tmp = tempfile.TemporaryDirectory(prefix="gpu_compare_")
    if a.no_peer:
        peer_why = "--no-peer"
    else:
        try:
            if a.peer:
                if not (os.path.isfile(a.peer) and os.access(a.peer, os.X_OK)):
                    raise ToolError(f"--peer {a.peer!r} is not an executable file")
                peer_exe = a.peer
            else:
                tar = Path(a.peer_tar) if a.peer_tar else default_peer_tar()
                if tar is None or not tar.is_file():
                    raise ToolError(f"no {PEER_TAR} (give --peer-tar or --peer; carry it into .carry/ on a GPU machine)")
                peer_exe = str(unpack_peer(tar, Path(tmp.name)))
        except (ToolError, OSError, tarfile.TarError) as e:
            peer_exe, peer_why = None, str(e)
    cublas, looked = find_cublas()
    if peer_exe and a.device == "cuda":
        if cublas is None:
            peer_why = (f"cuBLAS (libcublas.so.13, libcublasLt.so.13) not found ({looked}): llama.cpp's CUDA backend "
                        "cannot load; install the nvidia-cublas 13.x wheel or add a CUDA 13 toolkit's lib64 to "
                        "LD_LIBRARY_PATH")
            print(f"gpu_compare: {peer_why}", flush=True)
            peer_exe = None
        else:
            print(f"gpu_compare: cuBLAS: {cublas or 'on the loader path'}", flush=True)
            if cublas:
                peer_env = dict(os.environ)
                peer_env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in [cublas, os.environ.get("LD_LIBRARY_PATH")] if p)
    if not peer_exe:
        print(f"gpu_compare: llama.cpp unavailable: {peer_why}", flush=True)

    tools = [("stowlm", [stowlm_exe] + stowlm_args, None)]
    if a.device == "cuda" if a.graphs_off is None else a.graphs_off:
        tools.append(("stowlm no graphs", [stowlm_exe] + stowlm_args, dict(os.environ, STOWLM_CUDA_GRAPHS="0")))
    tools += [(label, [stowlm_exe] + stowlm_args + extra, env) for label, extra, env in variants]
    extra_columns = [t[0] for t in tools[1:]]  # every stowlm row but the first, in its own column
    if peer_exe:
        tools.append(("llama.cpp", [peer_exe] + peer_args, peer_env))
    samples: Dict[Tuple[str, str, str], List[float]] = {}
    calls: List[dict] = []
    errors: List[str] = []
    backends: Dict[str, str] = {}
    for rnd in range(1, a.rounds + 1):
        for model in models:
            for label, base, env in tools:
                cmd = base[:1] + ["-m", str(model)] + base[1:] + common
                try:
                    results, _ = run_tool(cmd, env, a.call_timeout)
                    if label == "llama.cpp" and a.device == "cuda":
                        off = sorted({r["backends"] for r in results if "CUDA" not in r["backends"]})
                        if off:
                            raise ToolError(f"llama-bench ran on {off}, not CUDA (its CUDA backend did not load): "
                                            f"{' '.join(cmd)}")
                except ToolError as e:
                    errors.append(f"round {rnd}, {model.stem}, {label}: {e}")
                    print(f"gpu_compare: {errors[-1]}", flush=True)
                    if label == "llama.cpp" and "not CUDA" in str(e):
                        tools = [t for t in tools if t[0] != "llama.cpp"]  # the same on every call: stop asking
                    continue
                for r in results:
                    samples.setdefault((model.stem, r["test"], label), []).extend(r["samples_ts"])
                    backends.setdefault(label, r["backends"])
                    print(f"  round {rnd} {model.stem:20s} {r['test']:8s} {label:16s} "
                          + " ".join(f"{x:.2f}" for x in r["samples_ts"]) + f"  (mean {r['avg_ts']:.2f} t/s)",
                          flush=True)
                    calls.append(dict(round=rnd, model=model.stem, tool=label, command=cmd, test=r["test"],
                                      samples_ts=r["samples_ts"], result=r["raw"]))

    kernels: Dict[str, List[str]] = {}
    if kernel_report:
        for model in models:
            cmd = [stowlm_exe, "-m", str(model)] + stowlm_args + ["-p", str(a.n_prompt), "-n", str(a.n_gen), "-r", "1",
                                                                "-o", "json", "-v"]
            try:
                _, err = run_tool(cmd, None, a.call_timeout)
                kernels[model.stem] = parse_kernel_report(err)
                for ln in err.splitlines():  # the report with each device's op table
                    if ln.startswith("  "):
                        print(f"  {model.stem}: {ln.strip()}" if " kernels per " in ln else ln, flush=True)
            except ToolError as e:
                errors.append(f"kernel report, {model.stem}: {e}")
                print(f"gpu_compare: {errors[-1]}", flush=True)

    # The table: medians over every sample of every round.
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    gpu = gpu_name() if a.device == "cuda" else ""
    cpu = platform.processor() or platform.machine()
    cpu = calls[0]["result"].get("cpu_info", cpu) if calls else cpu
    head = (f"{when}; device {a.device}" + (f" ({gpu})" if gpu else "") + f"; CPU {cpu}; "
            f"{a.rounds} round(s) x {a.repetitions} repetitions; stowlm-bench {' '.join(stowlm_args)}; "
            + (f"llama-bench {' '.join(peer_args)}" if peer_exe else f"llama.cpp unavailable: {peer_why}"))
    names = {"stowlm no graphs": "stowlm, CUDA graphs off"}
    lines = [head, "", "| model | test | stowlm t/s (median) | llama.cpp t/s (median) | stowlm/llama.cpp |"
             + "".join(f" {names.get(c, 'stowlm, ' + c)} |" for c in extra_columns),
             "| --- | --- | ---: | ---: | ---: |" + " ---: |" * len(extra_columns)]
    table = []
    for model in models:
        tests = []
        for (m, t, _), _v in samples.items():
            if m == model.stem and t not in tests:
                tests.append(t)
        for t in tests:
            ours, theirs = samples.get((model.stem, t, "stowlm")), samples.get((model.stem, t, "llama.cpp"))
            om = median(ours) if ours else None
            pm = median(theirs) if theirs else None
            ratio = om / pm if om and pm else None
            others = {c: samples.get((model.stem, t, c)) for c in extra_columns}
            others = {c: median(v) if v else None for c, v in others.items()}
            table.append(dict(model=model.stem, test=t, stowlm=om, llama_cpp=pm, ratio=ratio,
                              stowlm_no_graphs=others.get("stowlm no graphs"),
                              variants={c: v for c, v in others.items() if c != "stowlm no graphs"},
                              stowlm_samples=ours or [], llama_cpp_samples=theirs or []))
            cells = [f"{x:.2f}" if x is not None else "-" for x in (om, pm, ratio) + tuple(others.values())]
            lines.append(f"| {model.stem} | {t} | " + " | ".join(cells) + " |")
    if kernels:
        lines += ["", "stowlm-bench -v (one more run, kernels timed):"]
        for m, ls in kernels.items():
            lines += [f"- {m}: {ln}" for ln in ls] or [f"- {m}: no kernel report"]
    if errors:
        lines += ["", "Errors:"] + [f"- {e.splitlines()[0]}" for e in errors]
    md = "\n".join(lines) + "\n"
    print()
    print(md, end="")
    (out_dir / "gpu_compare.md").write_text(md)
    (out_dir / "gpu_compare.json").write_text(json.dumps(dict(
        header=head, device=a.device, gpu=gpu, rounds=a.rounds, repetitions=a.repetitions,
        stowlm_args=stowlm_args, peer_args=peer_args if peer_exe else None,
        peer_unavailable=None if peer_exe else peer_why, cublas=cublas, backends=backends, table=table,
        kernel_report=kernels, errors=errors, calls=calls), indent=1))
    print(f"gpu_compare: wrote {out_dir / 'gpu_compare.md'} and {out_dir / 'gpu_compare.json'}")
    tmp.cleanup()
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
