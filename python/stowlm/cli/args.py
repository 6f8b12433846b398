"""The command line's arguments: the parser of every command, and the settings its flags make
(sampling, structured output, devices and placement). Defaults shown in the help come from
stowlm.placement.rules, where the library takes them from."""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Optional

from ..version import __version__
from ..placement.budgets import MARGIN_DIVISOR, MARGIN_MAX
from ..placement.rules import (DEFAULT_FIT_CTX, DEFAULT_KV_TYPE, DEFAULT_MAX_CTX, DEFAULT_MOE_OFFLOAD_MIN,
                               DEFAULT_N_COPIES, DEFAULT_N_CTX,
                               DEFAULT_N_UBATCH, SPLIT_MODES)
from ..speculative import DRAFT_MAX

DEFAULT_MODEL = "smollm2-135m"


def add_sampling(p: argparse.ArgumentParser) -> None:
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
    g.add_argument("--typical", dest="typical_p", type=float, default=1.0,
                   help="locally typical sampling mass; 1 = off (default 1.0)")
    g.add_argument("--mirostat", type=int, default=0, choices=(0, 1, 2),
                   help="Mirostat sampling, version 1 or 2, in place of top-k/top-p/min-p; 0 = off (default 0)")
    g.add_argument("--mirostat-ent", dest="mirostat_tau", type=float, default=5.0,
                   help="Mirostat's target surprise tau, in bits (default 5.0)")
    g.add_argument("--mirostat-lr", dest="mirostat_eta", type=float, default=0.1,
                   help="Mirostat's learning rate eta (default 0.1)")
    g.add_argument("--seed", type=int, default=None, help="random seed (same seed, same text)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s = p.add_argument_group("structured output (pip install \"stowlm[structured]\")")
    s.add_argument("--json-schema", default=None, metavar="FILE",
                   help="generate only JSON valid against the JSON schema in FILE")
    s.add_argument("--grammar-file", default=None, metavar="FILE",
                   help="generate only text the grammar in FILE allows (llama.cpp's GBNF, or Lark)")


def sampling_kwargs(a: argparse.Namespace) -> dict:
    return dict(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                repeat_penalty=a.repeat_penalty, repeat_last_n=a.repeat_last_n,
                frequency_penalty=a.frequency_penalty, presence_penalty=a.presence_penalty,
                seed=a.seed, stop=a.stop, typical_p=a.typical_p, mirostat=a.mirostat,
                mirostat_tau=a.mirostat_tau, mirostat_eta=a.mirostat_eta)


def structured_kwargs(a: argparse.Namespace) -> dict:
    """--json-schema / --grammar-file, read and checked before the model loads."""
    from ..text import grammar

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


def add_model(p: argparse.ArgumentParser, default: Optional[str], what: str = "model name or .gguf path") -> None:
    """MODEL as a positional argument, or -m/--model as llama.cpp users type it."""
    p.add_argument("model", nargs="?", default=None,
                   help=what + (f" (default {default})" if default else "") + "; -m/--model works too")
    p.add_argument("-m", "--model", dest="model_option", default=None, metavar="MODEL", help=argparse.SUPPRESS)
    p.set_defaults(model_default=default)


def resolve_model(a: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    if not hasattr(a, "model_option"):
        return
    if a.model is not None and a.model_option is not None and a.model != a.model_option:
        p.error(f"two models given: {a.model} and -m {a.model_option}")
    a.model = a.model or a.model_option or a.model_default
    if a.model is None:
        p.error(f"{a.command}: a model is needed (MODEL or -m MODEL)")


def add_placement(p: argparse.ArgumentParser, for_fit: bool = False) -> None:
    """Devices and what fit may decide; every value given is kept."""
    g = p.add_argument_group("devices and placement")
    g.add_argument("--devices", default=None,
                   help="device list, e.g. 'cuda:0,cpu' or 'cpu:0[threads=1,mem=512MiB],cpu:1[threads=1]'; "
                        "'auto': every CUDA device and the CPU")
    g.add_argument("-c", "--ctx-size", type=int, default=None,
                   help="context size (default: " + ("the largest that fits, from the training context down to "
                                                     "--fit-ctx" if for_fit else f"min({DEFAULT_N_CTX}, trained), or "
                                                     "what fit chooses when it runs") + ")")
    g.add_argument("-ub", "--ubatch-size", type=int, default=None,
                   help=f"tokens per micro-batch (default {DEFAULT_N_UBATCH})")
    g.add_argument("--kv-type", default=None, choices=["f16", "q8_0"],
                   help=f"KV cache type (default {DEFAULT_KV_TYPE})")
    g.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", type=int, default=None, metavar="N",
                   help="llama.cpp's: the last N layers on cuda:0 and the rest on the CPU; -1 (or all): cuda:0 "
                        "and the CPU, fit keeping in RAM what the GPU cannot hold (instead of --devices)")
    g.add_argument("-ctk", "--cache-type-k", default=None, choices=["f16", "q8_0"],
                   help="llama.cpp's spelling of --kv-type (K and V share one type)")
    g.add_argument("-ctv", "--cache-type-v", default=None, choices=["f16", "q8_0"], help="the same, for V")
    g.add_argument("-fa", "--flash-attn", nargs="?", const="on", default=None, choices=["on", "off", "auto"],
                   help="taken from llama.cpp's command lines: stowlm's attention is always fused (flash); "
                        "'off' is refused")
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
                        f"min({MARGIN_MAX >> 20}, memory/{MARGIN_DIVISOR}) MiB)")
    g.add_argument("--fit-ctx", type=int, default=None, metavar="N",
                   help=f"the smallest context fit reduces to when none was given (default {DEFAULT_FIT_CTX})")
    g.add_argument("--n-copies", type=int, default=None, metavar="N",
                   help="copies of the tensors that cross devices, one per micro-batch in flight (pipeline "
                        f"parallelism over the layer split; default {DEFAULT_N_COPIES} where they fit, 1 = off)")
    g.add_argument("--interleave", type=int, default=None, metavar="N",
                   help="each device's layers in N ranges that take turns with the other devices' (shorter "
                        "pipeline stages; default 2 where only CPU devices hold layers and it fits, 1 = one "
                        "range each)")
    g.add_argument("--moe-offload-min", type=int, default=None, metavar="N",
                   help="with experts in RAM and their layers on a GPU: micro-batches of at least N tokens multiply "
                        "the experts on the GPU, which copies them in layer by layer (default "
                        f"{DEFAULT_MOE_OFFLOAD_MIN}; 0 = never; decoding leaves them to the CPU)")
    g.add_argument("--placement", default=None, metavar="FILE", help="load the placement saved in FILE "
                   "(from `stowlm fit --json` or -o)")
    if not for_fit:
        g.add_argument("--no-fit", action="store_true", help="load as given, without fitting")
        sp = p.add_argument_group("speculative decoding")
        sp.add_argument("--spec", default=None, metavar="ngram|DRAFT",
                        help="draft tokens and check them in one pass: 'ngram' (from the prompt and the text so "
                             "far) or a draft model's .gguf path or name (same vocabulary); greedy text is the same")
        sp.add_argument("--draft-max", type=int, default=None, metavar="N",
                        help=f"draft tokens per step at most (default {DRAFT_MAX})")
        sp.add_argument("--no-draft-lookup", dest="draft_lookup", action="store_false",
                        help="with a draft model: the model's drafts alone (by default prompt lookup drafts "
                             "too, where it yields more)")


def kv_type_of(a: argparse.Namespace):
    """--kv-type, or llama.cpp's -ctk/-ctv (one type for K and V)."""
    given = {f: v for f, v in (("--kv-type", a.kv_type), ("-ctk", a.cache_type_k), ("-ctv", a.cache_type_v)) if v}
    if len(set(given.values())) > 1:
        raise ValueError("stowlm keeps K and V in one type: " + ", ".join(f"{f} {v}" for f, v in given.items())
                         + " differ")
    if a.flash_attn == "off":
        raise ValueError("-fa off: stowlm's attention is always the fused (flash) kernel")
    return next(iter(given.values()), None)


def gpu_layer_devices(a: argparse.Namespace, kw: dict) -> None:
    """-ngl N as the devices and layer split in kw (placement_kwargs'), from the model's layer count."""
    if a.n_gpu_layers is None:
        return
    if kw["devices"] or kw["layer_split"]:
        raise ValueError("-ngl places the layers itself: give it or --devices / --layer-split, not both")
    from .. import _core
    from ..devices import gpu_layers
    from ..pull import pull

    n_layer = _core.engine.Projector(os.fspath(pull(a.model, progress=not getattr(a, "quiet", False)))).n_layer
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        devices, split = gpu_layers(a.n_gpu_layers, n_layer, "-ngl", getattr(a, "threads", None))
    for w in said:
        print(f"stowlm: warning: {w.message}", file=sys.stderr)
    kw["devices"], kw["layer_split"] = (",".join(devices) if devices else None), split


def placement_kwargs(a: argparse.Namespace) -> dict:
    devices = a.devices.strip() if a.devices else None
    split = number_list(a.layer_split, "--layer-split", int, "integers")
    shares = number_list(a.tensor_split, "--tensor-split", float, "numbers")
    if shares is not None and a.split_mode in (None, "layer"):
        raise ValueError("--tensor-split needs -sm tensor or tensor-sum")
    return dict(devices=devices, n_ctx=a.ctx_size, n_ubatch=a.ubatch_size, kv_type=kv_type_of(a), layer_split=split,
                tensor_overrides=a.override_tensor, cpu_moe=a.cpu_moe, n_cpu_moe=a.n_cpu_moe,
                n_copies=a.n_copies, margin=margins_mib(a.fit_margin), split_mode=a.split_mode, tensor_split=shares,
                interleave=a.interleave, moe_offload_min=a.moe_offload_min)


def number_list(text: Optional[str], flag: str, kind, what: str):
    """ "3,1" -> [3, 1] (None when not given); ValueError naming the flag."""
    if not text:
        return None
    try:
        return [kind(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} {text!r} is not a list of {what}") from None


def margins_mib(text: Optional[str]):
    """--fit-margin "1024" or "512,2048" (MiB; a unit may be given instead) -> bytes (one or a list)."""
    if text is None:
        return None
    from ..devices import parse_bytes

    out = []
    for item in text.split(","):
        item = item.strip()
        try:
            out.append(int(float(item) * (1 << 20)))
        except ValueError:
            out.append(parse_bytes(item))
    return out[0] if len(out) == 1 else out


def parser() -> argparse.ArgumentParser:
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
    add_model(r, DEFAULT_MODEL, "model name (see `stowlm pull --list`) or .gguf path")
    r.add_argument("-p", "--prompt", help="prompt to complete (no prompt: interactive chat)")
    r.add_argument("-f", "--file", default=None, metavar="FILE", help="read the prompt from FILE (as llama.cpp's -f)")
    r.add_argument("-n", "--n-predict", type=int, default=256, help="maximum tokens to generate (default 256)")
    r.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    r.add_argument("--chat", action="store_true", help="apply the chat template to PROMPT")
    r.add_argument("--system", "-sys", "--system-prompt", dest="system", default=None, help="system message for chat")
    r.add_argument("-q", "--quiet", action="store_true", help="do not print timings")
    add_placement(r)
    add_sampling(r)

    e = sub.add_parser("embed", help="print the embeddings of texts, one JSON array a line",
                       description="Embed each -p TEXT, or each line of -f FILE, with MODEL: its final hidden states "
                                   "pooled (by the file's pooling type, else their mean) and L2-normalized, one JSON "
                                   "array a line in the order given (llama.cpp's llama-embedding).")
    add_model(e, DEFAULT_MODEL, "model name or .gguf path")
    e.add_argument("-p", "--prompt", action="append", default=None, help="a text to embed (repeatable)")
    e.add_argument("-f", "--file", default=None, metavar="FILE", help="embed each non-empty line of FILE")
    e.add_argument("--pooling", choices=["mean", "last", "cls", "none"], default=None,
                   help="how a text's token vectors become one (default: the file's pooling_type, else mean; "
                        "none: a line of per-token arrays)")
    e.add_argument("--no-normalize", action="store_true", help="the pooled vectors as they are")
    e.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    e.add_argument("-q", "--quiet", action="store_true", help="no load messages")
    add_placement(e)

    f = sub.add_parser("fit", help="decide where a model's weights, KV cache and buffers go, and print it",
                       description="Fit MODEL on the devices: the context (when -c is not given), which layers "
                                   "and experts go on which device, and every device's bytes as the core projects "
                                   "them. Nothing is loaded unless --verify. Exit status 0 when it fits, 2 when not.")
    add_model(f, None)
    add_placement(f, for_fit=True)
    f.add_argument("--max-ctx", type=int, default=None, metavar="N", help=f"cap on the training context (default {DEFAULT_MAX_CTX})")
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
    add_model(sv, DEFAULT_MODEL)
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
    sv.add_argument("--embedding", "--embeddings", dest="embeddings", action="store_true",
                    help="serve /v1/embeddings instead of generating (the model's pooled, normalized final "
                         "hidden states; --parallel inputs a pass)")
    sv.add_argument("--pooling", choices=["mean", "last", "cls", "none"], default=None,
                    help="with --embeddings: how a text's token vectors become one (default: the file's "
                         "pooling_type, else mean)")
    add_placement(sv)

    pl = sub.add_parser("pull", help="download a model into the cache")
    pl.add_argument("name", nargs="?", help="model name")
    pl.add_argument("--list", action="store_true", help="list the known models")
    pl.add_argument("--verify", action="store_true", help="re-check the checksum of a cached file")

    i = sub.add_parser("info", help="show a model's architecture, metadata and tensors")
    add_model(i, None)
    i.add_argument("--tensors", action="store_true", help="list every tensor")
    i.add_argument("-c", "--ctx-size", type=int, default=DEFAULT_N_CTX, help="context for the memory projection")

    b = sub.add_parser("bench", help="run the native benchmark stowlm-bench (arguments pass through); with "
                                     "--spec ngram|DRAFT --prompt-file FILE, speculative against plain decoding",
                       add_help=False)
    b.add_argument("args", nargs=argparse.REMAINDER)
    return p
