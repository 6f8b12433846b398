"""The `stowlm` command line: run, serve, fit, pull, info, bench."""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from typing import List, Optional

from . import __version__
from .placement import SPLIT_MODES

DEFAULT_MODEL = "smollm2-135m"


def _add_sampling(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temp", "--temperature", dest="temperature", type=float, default=0.8,
                   help="temperature; 0 = greedy (default 0.8)")
    g.add_argument("--top-k", type=int, default=40, help="keep the k most likely tokens; 0 = off (default 40)")
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass; 1 = off (default 0.95)")
    g.add_argument("--min-p", type=float, default=0.05, help="drop tokens below min-p x the best; 0 = off (default 0.05)")
    g.add_argument("--repeat-penalty", type=float, default=1.0, help="penalise recent tokens; 1 = off (default 1.0)")
    g.add_argument("--repeat-last-n", type=int, default=64, help="window of the penalties (default 64)")
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None, help="random seed (same seed, same text)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s = p.add_argument_group("structured output (pip install \"stowlm[structured]\")")
    s.add_argument("--json-schema", default=None, metavar="FILE",
                   help="generate only JSON valid against the JSON schema in FILE")
    s.add_argument("--grammar-file", default=None, metavar="FILE",
                   help="generate only text the grammar in FILE allows (llama.cpp's GBNF, or Lark)")


def _sampling_kwargs(a: argparse.Namespace) -> dict:
    return dict(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                repeat_penalty=a.repeat_penalty, repeat_last_n=a.repeat_last_n,
                frequency_penalty=a.frequency_penalty, presence_penalty=a.presence_penalty,
                seed=a.seed, stop=a.stop)


def _structured_kwargs(a: argparse.Namespace) -> dict:
    """--json-schema / --grammar-file, read and checked before the model loads."""
    from .text import grammar

    if a.json_schema and a.grammar_file:
        raise ValueError("give --json-schema or --grammar-file, not both")
    if a.json_schema:
        import json

        try:
            with open(a.json_schema, encoding="utf-8") as f:
                schema = json.load(f)
        except ValueError as e:
            raise ValueError(f"--json-schema {a.json_schema}: not valid JSON: {e}") from None
        try:
            grammar.json_schema(schema, param="--json-schema")
        except grammar.FieldError as e:
            raise ValueError(f"--json-schema {a.json_schema}: {e.reason}") from None
        return {"json_schema": schema}
    if a.grammar_file:
        with open(a.grammar_file, encoding="utf-8") as f:
            text = f.read()
        try:
            grammar.gbnf(text, param="--grammar-file")
        except grammar.FieldError as e:
            raise ValueError(f"--grammar-file {a.grammar_file}: {e.reason}") from None
        return {"grammar": text}
    return {}


def _add_model(p: argparse.ArgumentParser, default: Optional[str], what: str = "model name or .gguf path") -> None:
    """MODEL as a positional argument, or -m/--model as llama.cpp users type it."""
    p.add_argument("model", nargs="?", default=None,
                   help=what + (f" (default {default})" if default else "") + "; -m/--model works too")
    p.add_argument("-m", "--model", dest="model_option", default=None, metavar="MODEL", help=argparse.SUPPRESS)
    p.set_defaults(model_default=default)


def _resolve_model(a: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    if not hasattr(a, "model_option"):
        return
    if a.model is not None and a.model_option is not None and a.model != a.model_option:
        p.error(f"two models given: {a.model} and -m {a.model_option}")
    a.model = a.model or a.model_option or a.model_default
    if a.model is None:
        p.error(f"{a.command}: a model is needed (MODEL or -m MODEL)")


def _add_placement(p: argparse.ArgumentParser, for_fit: bool = False) -> None:
    """Devices and what fit may decide; every value given is kept."""
    g = p.add_argument_group("devices and placement")
    g.add_argument("--devices", default=None,
                   help="device list, e.g. 'cuda:0,cpu' or 'cpu:0[threads=1,mem=512MiB],cpu:1[threads=1]'; "
                        "'auto': every CUDA device and the CPU")
    g.add_argument("-c", "--ctx-size", type=int, default=None,
                   help="context size (default: " + ("the largest that fits, from the training context down to "
                                                     "--fit-ctx" if for_fit else "min(4096, trained), or what fit "
                                                     "chooses when it runs") + ")")
    g.add_argument("-ub", "--ubatch-size", type=int, default=None, help="tokens per micro-batch (default 512)")
    g.add_argument("--kv-type", default=None, choices=["f16", "q8_0"], help="KV cache type (default f16)")
    g.add_argument("--layer-split", default=None, metavar="N,N,...",
                   help="layers per device, in the order of --devices")
    g.add_argument("-sm", "--split-mode", default=None, choices=SPLIT_MODES,
                   help="layer: ranges of layers per device (default); tensor: every layer cut over the "
                        "devices, which all work on every token (tensor parallelism; the logits one device's "
                        "bit for bit); tensor-sum: the same, the devices' partial products summed (half the "
                        "meetings and fewer bytes between devices; results within float rounding)")
    g.add_argument("-ts", "--tensor-split", default=None, metavar="N,N,...",
                   help="with -sm tensor[-sum]: the devices' shares (default: from their free memory)")
    g.add_argument("-ot", "--override-tensor", action="append", default=None, metavar="REGEX=DEVICE",
                   help="put the weights whose names match REGEX on DEVICE (repeatable; first match wins)")
    g.add_argument("--cpu-moe", action="store_true", help="keep every expert tensor on the CPU")
    g.add_argument("--n-cpu-moe", type=int, default=None, metavar="N",
                   help="keep the experts of the first N layers on the CPU")
    g.add_argument("--fit-margin", default=None, metavar="MiB[,MiB...]",
                   help="memory fit leaves free on each device, one value or one per device (default "
                        "min(1024, memory/16) MiB)")
    g.add_argument("--fit-ctx", type=int, default=None, metavar="N",
                   help="the smallest context fit reduces to when none was given (default 4096)")
    g.add_argument("--n-copies", type=int, default=None, metavar="N",
                   help="copies of the tensors that cross devices, one per micro-batch in flight (pipeline "
                        "parallelism over the layer split; default 4 where they fit, 1 = off)")
    g.add_argument("--interleave", type=int, default=None, metavar="N",
                   help="each device's layers in N ranges that take turns with the other devices' (shorter "
                        "pipeline stages; default 2 where only CPU devices hold layers and it fits, 1 = one "
                        "range each)")
    g.add_argument("--placement", default=None, metavar="FILE", help="load the placement saved in FILE "
                   "(from `stowlm fit --json` or -o)")
    if not for_fit:
        g.add_argument("--no-fit", action="store_true", help="load as given, without fitting")
        sp = p.add_argument_group("speculative decoding")
        sp.add_argument("--spec", default=None, metavar="ngram|DRAFT",
                        help="draft tokens and check them in one pass: 'ngram' (from the prompt and the text so "
                             "far) or a draft model's .gguf path or name (same vocabulary); greedy text is the same")
        sp.add_argument("--draft-max", type=int, default=None, metavar="N",
                        help="draft tokens per step at most (default 7)")


def _placement_kwargs(a: argparse.Namespace) -> dict:
    devices = a.devices.strip() if a.devices else None
    split = _number_list(a.layer_split, "--layer-split", int, "integers")
    shares = _number_list(a.tensor_split, "--tensor-split", float, "numbers")
    if shares is not None and a.split_mode in (None, "layer"):
        raise ValueError("--tensor-split needs -sm tensor or tensor-sum")
    return dict(devices=devices, n_ctx=a.ctx_size, n_ubatch=a.ubatch_size, kv_type=a.kv_type, layer_split=split,
                tensor_overrides=a.override_tensor, cpu_moe=a.cpu_moe, n_cpu_moe=a.n_cpu_moe,
                n_copies=a.n_copies, margin=_margins_mib(a.fit_margin), split_mode=a.split_mode, tensor_split=shares,
                interleave=a.interleave)


def _number_list(text: Optional[str], flag: str, kind, what: str):
    """ "3,1" -> [3, 1] (None when not given); ValueError naming the flag."""
    if not text:
        return None
    try:
        return [kind(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} {text!r} is not a list of {what}") from None


def _margins_mib(text: Optional[str]):
    """--fit-margin "1024" or "512,2048" (MiB; a unit may be given instead) -> bytes (one or a list)."""
    if text is None:
        return None
    from .devices import parse_bytes

    out = []
    for item in text.split(","):
        item = item.strip()
        try:
            out.append(int(float(item) * (1 << 20)))
        except ValueError:
            out.append(parse_bytes(item))
    return out[0] if len(out) == 1 else out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stowlm",
        description="Run GGUF language models fast on the memory you have.",
        epilog="Examples:\n"
               "  stowlm run -p 'The capital of France is' -n 32   # pulls smollm2-135m on first use\n"
               "  stowlm run qwen2.5-coder-0.5b                       # interactive chat\n"
               "  stowlm serve qwen2.5-coder-0.5b --parallel 4       # OpenAI-compatible API on :8080\n"
               "  stowlm pull gemma3-270m\n"
               "  stowlm info ./model.gguf\n"
               "  stowlm fit qwen2.5-coder-0.5b --devices 'cpu:1[mem=256MiB],cpu:0' --explain",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"stowlm {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    r = sub.add_parser("run", help="generate text, or chat when no prompt is given",
                       description="Generate a completion of PROMPT, or chat interactively when no prompt is given.")
    _add_model(r, DEFAULT_MODEL, "model name (see `stowlm pull --list`) or .gguf path")
    r.add_argument("-p", "--prompt", help="prompt to complete (no prompt: interactive chat)")
    r.add_argument("-n", "--n-predict", type=int, default=256, help="maximum tokens to generate (default 256)")
    r.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    r.add_argument("--chat", action="store_true", help="apply the chat template to PROMPT")
    r.add_argument("--system", default=None, help="system message for chat")
    r.add_argument("-q", "--quiet", action="store_true", help="do not print timings")
    _add_placement(r)
    _add_sampling(r)

    f = sub.add_parser("fit", help="decide where a model's weights, KV cache and buffers go, and print it",
                       description="Fit MODEL on the devices: the context (when -c is not given), which layers "
                                   "and experts go on which device, and every device's bytes as the core projects "
                                   "them. Nothing is loaded unless --verify. Exit status 0 when it fits, 2 when not.")
    _add_model(f, None)
    _add_placement(f, for_fit=True)
    f.add_argument("--max-ctx", type=int, default=None, metavar="N", help="cap on the training context (default 131072)")
    f.add_argument("--json", action="store_true", help="print the placement as JSON instead of the table")
    f.add_argument("-o", "--output", default=None, metavar="FILE", help="save the placement as JSON in FILE")
    f.add_argument("--verify", action="store_true",
                   help="load the placement, evaluate a prompt of n_ubatch tokens and report the bytes each "
                        "device allocated")
    f.add_argument("--explain", action="store_true", help="print each decision with its reason")

    sv = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                        description="Serve MODEL at http://HOST:PORT/v1 (chat/completions, completions, models), "
                                    "/health and /metrics, PARALLEL requests at once (continuous batching); "
                                    "more wait in a queue. Ctrl-C stops.")
    _add_model(sv, DEFAULT_MODEL)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sv.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 = any free port)")
    sv.add_argument("-np", "--parallel", type=int, default=4,
                    help="requests served at once; the context is shared equally (default 4)")
    sv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: "
                    "$STOWLM_API_KEY if set, else none)")
    sv.add_argument("--alias", default=None, help="the model name clients use (default: the file name)")
    sv.add_argument("--max-queue", type=int, default=128, help="waiting requests before 503 (default 128)")
    sv.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    sv.add_argument("-q", "--quiet", action="store_true", help="no load messages")
    _add_placement(sv)

    pl = sub.add_parser("pull", help="download a model into the cache")
    pl.add_argument("name", nargs="?", help="model name")
    pl.add_argument("--list", action="store_true", help="list the known models")
    pl.add_argument("--verify", action="store_true", help="re-check the checksum of a cached file")

    i = sub.add_parser("info", help="show a model's architecture, metadata and tensors")
    _add_model(i, None)
    i.add_argument("--tensors", action="store_true", help="list every tensor")
    i.add_argument("-c", "--ctx-size", type=int, default=4096, help="context for the memory projection")

    b = sub.add_parser("bench", help="run the native benchmark stowlm-bench (arguments pass through)",
                       add_help=False)
    b.add_argument("args", nargs=argparse.REMAINDER)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from . import mpi  # under mpirun every rank takes its part there (stowlm/mpi.py)

    if mpi.launched():
        return mpi.main(argv)
    p = _parser()
    if argv[:1] == ["bench"]:
        # argparse's REMAINDER refuses a first argument that looks like an option ("-m"):
        # everything after "bench" belongs to stowlm-bench.
        a = argparse.Namespace(command="bench", args=list(argv[1:]))
    else:
        a = p.parse_args(argv)
        _resolve_model(a, p)
    if a.command is None:
        p.print_help()
        return 0
    try:
        return {"run": _run, "pull": _pull, "info": _info, "bench": _bench, "fit": _fit,
                "serve": _serve}[a.command](a)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except MemoryError as e:
        from .fit import FitError

        print(f"stowlm: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, FitError) else 1
    except (ValueError, FileNotFoundError, MemoryError, RuntimeError, OSError) as e:
        print(f"stowlm: error: {e}", file=sys.stderr)
        return 1


def _run(a: argparse.Namespace) -> int:
    if a.n_predict is not None and a.n_predict < 0:
        raise ValueError(f"-n must be >= 0, got {a.n_predict}")
    kw = _sampling_kwargs(a)
    # validate sampling values before the (slow) load
    from .text.sampling import SamplingParams

    SamplingParams(max_tokens=a.n_predict, **kw)
    kw.update(_structured_kwargs(a))
    llm = _load(a)
    with llm:
        if a.prompt is None:
            return _interactive(llm, a, kw)
        if a.chat:
            msgs = ([{"role": "system", "content": a.system}] if a.system else [])
            msgs.append({"role": "user", "content": a.prompt})
            it = llm.chat(msgs, stream=True, max_tokens=a.n_predict, **kw)
        else:
            sys.stdout.write(a.prompt)
            it = llm.generate(a.prompt, stream=True, max_tokens=a.n_predict, **kw)
        _stream(it, a.quiet)
    return 0


def _load(a: argparse.Namespace, **extra):
    """The LLM the device, placement and fit options of run and serve describe."""
    from .llm import LLM

    kw_place = _placement_kwargs(a)
    margin = kw_place.pop("margin")
    if a.placement:
        given = [k for k, v in kw_place.items() if v]
        if given:
            raise ValueError(f"--placement fixes the devices and what fit decides; drop {', '.join(given)}")
        kw_place = {}
    t0 = time.perf_counter()
    if a.draft_max is not None and a.spec is None:
        raise ValueError("--draft-max needs --spec")
    llm = LLM(a.model, n_threads=a.threads, progress=not a.quiet, fit=False if a.no_fit else None,
              placement=a.placement, fit_margin=margin, fit_ctx=a.fit_ctx, speculative=a.spec, draft_max=a.draft_max,
              **kw_place, **extra)
    if not a.quiet:
        print(f"[loaded {os.path.basename(llm.path)} in {time.perf_counter() - t0:.2f} s]", file=sys.stderr)
    return llm


def _serve(a: argparse.Namespace) -> int:
    if a.parallel < 1:
        raise ValueError(f"--parallel must be >= 1, got {a.parallel}")
    if a.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {a.max_queue}")
    if not 0 <= a.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {a.port}")
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"stowlm serve needs starlette and uvicorn ({e}); pip install starlette uvicorn") from None
    from .serve.app import serve

    llm = _load(a, n_seq=a.parallel)
    serve(llm, host=a.host, port=a.port, model_id=a.alias, api_key=a.api_key or os.environ.get("STOWLM_API_KEY"),
          max_queue=a.max_queue)
    return 0


def _fit(a: argparse.Namespace) -> int:
    from . import fit as fitting
    from .pull import pull

    path = pull(a.model, progress=not a.json)
    kw = _placement_kwargs(a)
    if a.placement:
        from .placement import Placement

        placement = Placement.load(a.placement)
        if kw["devices"]:  # the placement's own devices may be named again, in any order
            differ = placement.device_difference(kw["devices"])
            if differ:
                raise ValueError(f"--devices {kw['devices']} are not the placement's devices ({differ}); drop "
                                 "--devices or give the placement's")
            kw["devices"] = None
        given = [k for k, v in kw.items() if v and k != "margin"]
        if given:
            raise ValueError(f"--placement fixes the devices and what fit decides; drop {', '.join(given)}")
        kw = {"margin": kw["margin"], "placement": placement}
    if a.fit_ctx is not None:
        kw["fit_ctx"] = a.fit_ctx
    if a.max_ctx is not None:
        kw["max_ctx"] = a.max_ctx
    try:
        placement = fitting.fit(path, **kw)
    except fitting.FitError as e:
        print(f"stowlm fit: {e}", file=sys.stderr)
        return 2
    if a.verify:
        _verify(path, placement)
    if a.output:
        placement.save(a.output)
    if a.json:
        print(placement.to_json())
        return 0
    print(placement.table())
    if a.explain:
        print("decisions:")
        print(placement.explain())
    return 0


def _verify(path: str, placement) -> None:
    """Loads the placement, evaluates n_ubatch tokens and records what each device allocated."""
    from .engine import Context, Model

    model = Model(path, placement=placement)
    ctx = Context(model)
    n = min(placement.n_ubatch, placement.n_ctx)
    ctx.eval([i % model.n_vocab for i in range(n)], logits="last")
    report = {r["device"]: r["allocated"] for r in ctx.memory_report()}
    for d in placement.used_devices:
        d.allocated = report[d.name]
        if d.allocated != d.projected["total"]:
            raise RuntimeError(f"{d.name} allocated {d.allocated} bytes, fit projected {d.projected['total']}: "
                               "please report this")


def _stream(it, quiet: bool) -> None:
    t0 = time.perf_counter()
    first = None
    for piece in it:
        if first is None:
            first = time.perf_counter()
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    c = it.completion
    if not quiet and c is not None:
        t1 = time.perf_counter()
        gen_s = (t1 - first) if first else 0.0
        rate = (c.completion_tokens - 1) / gen_s if gen_s > 0 and c.completion_tokens > 1 else 0.0
        drafts = f", drafts kept {c.accepted} of {c.drafted}" if getattr(c, "drafted", 0) else ""
        print(f"[prompt {c.prompt_tokens} tokens, generated {c.completion_tokens} tokens, "
              f"{rate:.1f} tokens/s, finish: {c.finish_reason}, first token after "
              f"{((first or t1) - t0):.2f} s{drafts}]", file=sys.stderr)


def _interactive(llm, a: argparse.Namespace, kw: dict) -> int:
    msgs = [{"role": "system", "content": a.system}] if a.system else []
    print("chat with the model; empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not line.strip():
            return 0
        msgs.append({"role": "user", "content": line})
        it = llm.chat(msgs, stream=True, max_tokens=a.n_predict, **kw)
        _stream(it, a.quiet)
        msgs.append({"role": "assistant", "content": it.completion.text})


def _pull(a: argparse.Namespace) -> int:
    from . import pull

    if a.list or not a.name:
        for m in pull.list_models():
            state = m["path"] or "not downloaded"
            print(f"{m['name']:<22} {m['size'] / 1e6:7.1f} MB  {m['description']}  [{state}]")
        return 0
    path = pull.pull(a.name, verify=a.verify)
    print(path)
    return 0


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _info(a: argparse.Namespace) -> int:
    from . import pull
    from .engine import plan
    from .gguffile import GGUFFile

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
    print(f"tensors:       {len(tensors)}, {_fmt_bytes(total)}, {n_params / 1e6:.1f} M parameters")
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
        print(f"  {name:<8} {count:5d} tensors  {_fmt_bytes(nbytes)}")
    if a.tensors:
        for t in tensors:
            print(f"  {t[0]:<40} {t[1]:<8} {str(tuple(t[2])):<20} {_fmt_bytes(t[3])}")
    try:
        rows = plan(path, n_ctx=a.ctx_size)
        print(f"memory on each device (n_ctx={a.ctx_size}):")
        for r in rows:
            print(f"  {r['device']:<10} weights {_fmt_bytes(r['weights'])}, KV {_fmt_bytes(r['kv'])}, "
                  f"compute {_fmt_bytes(r['compute'])}, total {_fmt_bytes(r['total'])}")
    except ValueError as e:  # e.g. an architecture the engine does not know
        print(f"memory projection unavailable: {e}")
    return 0


def _bench(a: argparse.Namespace) -> int:
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "stowlm-bench")
    exe = here if os.path.exists(here) else shutil.which("stowlm-bench")
    if exe is None:
        raise FileNotFoundError("stowlm-bench is not installed with this package")
    return subprocess.call([exe] + list(a.args))


if __name__ == "__main__":
    sys.exit(main())
