"""The commands that load a model: run (a completion or a chat), serve (the HTTP API) and fit
(where the model goes, printed or saved)."""
from __future__ import annotations

import argparse
import os
import sys
import time

from .args import gpu_layer_devices, placement_kwargs, sampling_kwargs, structured_kwargs


def run(a: argparse.Namespace) -> int:
    if a.n_predict is not None and a.n_predict < 0:
        raise ValueError(f"-n must be >= 0, got {a.n_predict}")
    kw = sampling_kwargs(a)
    # validate sampling values before the (slow) load
    from ..text.sampling import SamplingParams

    SamplingParams(max_tokens=a.n_predict, **kw)
    kw.update(structured_kwargs(a))
    if a.file is not None:
        if a.prompt is not None:
            raise ValueError("give the prompt with -p or -f, not both")
        try:
            with open(a.file, encoding="utf-8") as f:
                a.prompt = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"-f {a.file}: {e}") from None
    llm = load(a)
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


def load(a: argparse.Namespace, **extra):
    """The LLM the device, placement and fit options of run and serve describe."""
    from ..llm import LLM

    kw_place = placement_kwargs(a)
    gpu_layer_devices(a, kw_place)
    margin = kw_place.pop("margin")
    placement = a.placement
    if placement:
        placement = _given_placement(placement, kw_place)
        given = [k for k, v in kw_place.items() if v is not None and v is not False]
        if given:
            raise ValueError(f"--placement fixes the devices and what fit decides; drop {', '.join(given)}")
        kw_place = {}
    t0 = time.perf_counter()
    if a.draft_max is not None and a.spec is None:
        raise ValueError("--draft-max needs --spec")
    if not a.draft_lookup and a.spec in (None, "ngram"):
        raise ValueError("--no-draft-lookup needs --spec DRAFT (a draft model)")
    llm = LLM(a.model, n_threads=a.threads, progress=not a.quiet, fit=False if a.no_fit else None,
              placement=placement, fit_margin=margin, fit_ctx=a.fit_ctx, speculative=a.spec, draft_max=a.draft_max,
              draft_lookup=a.draft_lookup, **kw_place, **extra)
    if not a.quiet:
        print(f"[loaded {os.path.basename(llm.path)} in {time.perf_counter() - t0:.2f} s]", file=sys.stderr)
    return llm


def embed(a: argparse.Namespace) -> int:
    """llama-embedding's job: each text's embedding, a JSON array a line."""
    import json

    texts = list(a.prompt or [])
    if a.file is not None:
        try:
            with open(a.file, encoding="utf-8") as f:
                texts += [line for line in f.read().splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"-f {a.file}: {e}") from None
    if not texts:
        raise ValueError("nothing to embed: give -p TEXT (repeatable) or -f FILE")
    if a.spec is not None:
        raise ValueError("--spec drafts tokens to generate; embed generates none")
    with load(a, embedding=True, pooling=a.pooling) as llm:
        for v in llm.embed(texts, normalize=not a.no_normalize):
            print(json.dumps(v))
    return 0


def _given_placement(file: str, kw: dict, always: bool = False):
    """The placement in FILE (loaded when --devices must be checked against it, or `always`; else
    the file name, which LLM loads). --devices may name the placement's own devices again, in any
    order: they are taken out of `kw`; other devices are refused, naming what differs."""
    if not kw["devices"] and not always:
        return file
    from ..placement import Placement

    placement = Placement.load(file)
    if kw["devices"]:
        differ = placement.device_difference(kw["devices"])
        if differ:
            raise ValueError(f"--devices {kw['devices']} are not the placement's devices ({differ}); drop "
                             "--devices or give the placement's")
        kw["devices"] = None
    return placement


def serve(a: argparse.Namespace) -> int:
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
    from ..serve.app import serve as serve_http

    if a.pooling is not None and not a.embeddings:
        raise ValueError("--pooling needs --embeddings")
    extra = {"embedding": True, "pooling": a.pooling} if a.embeddings else {}
    if a.embeddings and a.spec is not None:
        raise ValueError("--spec drafts tokens to generate; an --embeddings server generates none")
    llm = load(a, n_seq=a.parallel, **extra)
    serve_http(llm, host=a.host, port=a.port, model_id=a.alias,
               api_key=a.api_key or os.environ.get("STOWLM_API_KEY"), max_queue=a.max_queue)
    return 0


def fit(a: argparse.Namespace) -> int:
    from .. import fit as fitting
    from ..pull import pull

    path = pull(a.model, progress=not a.json)
    kw = placement_kwargs(a)
    gpu_layer_devices(a, kw)
    if a.placement:
        placement = _given_placement(a.placement, kw, always=True)
        given = [k for k, v in kw.items() if v is not None and v is not False and k != "margin"]
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
    from ..engine import Context, Model

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
