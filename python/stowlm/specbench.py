"""Speculative decoding measured against plain decoding on one's own prompts:

    stowlm bench -m qwen2.5-coder-0.5b --spec ngram --prompt-file edits.json [-n 256] [-r 3]

Greedy chat answers, with and without drafts in alternating order round by round; for each
prompt the generation rate after the first token both ways, their ratio, the draft tokens kept,
and whether the text is the same (it must be: the exit status is 1 where it is not).
bench/spec_bench.py runs the same measurement on its built-in code edits and questions.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from .placement.rules import DEFAULT_N_CTX

__all__ = ["load_prompts", "generation_rate", "measure", "heading", "table", "main"]


def load_prompts(path) -> List[dict]:
    """A prompt file: a JSON list of strings or of {"name", "content"[, "kind"]} objects, or plain
    text: one prompt, or several separated by lines that hold only ``---``. Each prompt becomes
    {"name", "kind", "content"} (kind "edit" or "open" groups the geometric means; default "prompt")."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"prompt file {p} does not exist") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"prompt file {p} is not UTF-8 text: {e}") from None
    items: List[dict] = []
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"prompt file {p}: not valid JSON: {e}") from None
        if not isinstance(data, list):
            raise ValueError(f"prompt file {p}: expected a JSON list of prompts, got {type(data).__name__}")
        for i, d in enumerate(data):
            if isinstance(d, str):
                d = {"content": d}
            if not isinstance(d, dict) or not isinstance(d.get("content"), str):
                raise ValueError(f"prompt file {p}: item {i} is neither a string nor an object with a string "
                                 f"'content'")
            items.append({"name": str(d.get("name", f"prompt {i + 1}")), "kind": str(d.get("kind", "prompt")),
                          "content": d["content"]})
    else:
        parts, cur = [], []
        for line in text.splitlines():
            if line.strip() == "---":
                parts.append("\n".join(cur))
                cur = []
            else:
                cur.append(line)
        parts.append("\n".join(cur))
        items = [{"name": f"prompt {i + 1}", "kind": "prompt", "content": c.strip()}
                 for i, c in enumerate(x for x in parts if x.strip())]
    items = [it for it in items if it["content"].strip()]
    if not items:
        raise ValueError(f"prompt file {p} holds no prompt")
    return items


def generation_rate(llm, prompt: str, n: int):
    """(tokens per second after the first token, the completion) of a greedy chat answer; the
    rate is NaN for an answer of one token."""
    it = llm.chat([{"role": "user", "content": prompt}], max_tokens=n, temperature=0, stream=True)
    first = None
    for _ in it:
        first = first or time.perf_counter()
    c = it.completion
    dt = time.perf_counter() - first if first is not None else 0.0
    return ((c.completion_tokens - 1) / dt if c.completion_tokens > 1 and dt > 0 else math.nan), c


def measure(plain, spec, prompts: Sequence[dict], n: int, rounds: int,
            log: Optional[Callable[[str], None]] = None) -> List[dict]:
    """Each prompt answered by both LLMs (`plain` without drafts, `spec` with), `rounds` times in
    alternating order. Returns a row per prompt: name, kind, tokens, plain and spec (the rates of
    every round), drafted and accepted (the last spec answer's), same (every round's text)."""
    rows = [{"name": p["name"], "kind": p.get("kind", "prompt"), "tokens": 0, "plain": [], "spec": [],
             "drafted": 0, "accepted": 0, "same": True} for p in prompts]
    for r in range(rounds):
        for p, row in zip(prompts, rows):
            order = [("plain", plain), ("spec", spec)] if r % 2 == 0 else [("spec", spec), ("plain", plain)]
            got: Dict[str, object] = {}
            for label, llm in order:
                rate, c = generation_rate(llm, p["content"], n)
                row[label].append(rate)
                got[label] = c
            row["same"] &= got["plain"].tokens == got["spec"].tokens
            row["drafted"], row["accepted"] = got["spec"].drafted, got["spec"].accepted
            row["tokens"] = got["plain"].completion_tokens
            if log:
                log(f"round {r + 1} {p['name']:<12} plain {row['plain'][-1]:6.1f} t/s  spec {row['spec'][-1]:6.1f} t/s")
    for row in rows:
        row["plain_median"] = statistics.median(row["plain"])
        row["spec_median"] = statistics.median(row["spec"])
        row["ratio"] = row["spec_median"] / row["plain_median"]
    return rows


def heading(plain, spec, spec_arg, draft_lookup: bool, rounds: int) -> str:
    """The line above the table: the model, the drafting, the rounds."""
    lookup = "" if draft_lookup or spec_arg == "ngram" else " (no lookup)"
    return (f"{Path(str(plain.path)).name}, spec={spec_arg}{lookup}, draft_max={spec.draft_max}, {rounds} rounds, "
            "medians:")


def table(rows: Sequence[dict]) -> str:
    """The rows as a Markdown table (medians), then the geometric mean of the ratios of each kind."""
    out = ["| prompt | kind | tokens | plain t/s | spec t/s | ratio | accepted / drafted | identical |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    kinds: Dict[str, List[float]] = {}
    for row in rows:
        out.append(f"| {row['name']} | {row['kind']} | {row['tokens']} | {row['plain_median']:.1f} | "
                   f"{row['spec_median']:.1f} | {row['ratio']:.2f}x | {row['accepted']} / {row['drafted']} | "
                   f"{'yes' if row['same'] else 'NO'} |")
        if math.isfinite(row["ratio"]):
            kinds.setdefault(row["kind"], []).append(row["ratio"])
    for kind, rs in kinds.items():
        out.append(f"{kind}: geometric mean ratio {statistics.geometric_mean(rs):.2f}x")
    return "\n".join(out)


def main(argv: Sequence[str]) -> int:
    """`stowlm bench --spec ...`: the arguments after "bench"."""
    ap = argparse.ArgumentParser(prog="stowlm bench --spec", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True, help="the model (.gguf path or a name of stowlm pull)")
    ap.add_argument("--spec", required=True, metavar="ngram|DRAFT", help="prompt lookup, or a draft model")
    ap.add_argument("--prompt-file", required=True, metavar="FILE",
                    help="a JSON list of prompts (strings or {name, content, kind}) or text, prompts split by '---' lines")
    ap.add_argument("--draft-max", type=int, default=None)
    ap.add_argument("--no-draft-lookup", dest="draft_lookup", action="store_false",
                    help="a draft model's drafts alone (default: prompt lookup beside it)")
    ap.add_argument("-n", "--n-gen", type=int, default=256, help="max tokens per answer (256)")
    ap.add_argument("-r", "--repetitions", type=int, default=3, help="rounds, alternating the order (3)")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("-c", "--ctx-size", type=int, default=DEFAULT_N_CTX)
    ap.add_argument("-o", "--output", choices=["md", "json"], default="md")
    a = ap.parse_args(list(argv))
    if a.n_gen < 2 or a.repetitions < 1:
        ap.error("-n must be >= 2 and -r >= 1")
    prompts = load_prompts(a.prompt_file)
    from . import LLM

    kw = dict(n_ctx=a.ctx_size, n_threads=a.threads, progress=False)
    plain = LLM(a.model, **kw)
    spec = LLM(a.model, speculative=a.spec, draft_max=a.draft_max, draft_lookup=a.draft_lookup, **kw)
    log = None if a.output == "json" else (lambda s: print(s, file=sys.stderr, flush=True))
    rows = measure(plain, spec, prompts, a.n_gen, a.repetitions, log)
    if a.output == "json":
        def finite(x):  # NaN (a one-token answer's rate) as null: strict JSON
            return None if isinstance(x, float) and not math.isfinite(x) else x

        rows = [{k: ([finite(x) for x in v] if isinstance(v, list) else finite(v)) for k, v in r.items()} for r in rows]
        print(json.dumps({"model": str(plain.path), "spec": a.spec, "draft_lookup": a.draft_lookup,
                          "draft_max": spec.draft_max,
                          "rounds": a.repetitions, "rows": rows}, indent=1))
    else:
        print(heading(plain, spec, a.spec, a.draft_lookup, a.repetitions))
        print(table(rows))
    return 0 if all(r["same"] for r in rows) else 1
