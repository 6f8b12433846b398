"""Speculative decoding against plain decoding on code edits and open questions, same prompts,
greedy, alternating rounds: generation tokens/s (after the first token), the ratio, the drafts
accepted, and whether the text is identical (it must be).

    python bench/spec_bench.py -m qwen2.5-coder-0.5b --rounds 3
    python bench/spec_bench.py -m qwen2.5-coder-0.5b --spec draft.gguf     # a draft model

--prompts FILE takes other prompts: a JSON list of {"name", "kind": "edit" | "open", "content"}
(`stowlm bench --spec ngram --prompt-file FILE` is the same measurement from the installed package).
--concurrent N instead sends the first N prompts at once to an LLM of N slots (continuous
batching), with and without drafts, and reports the wall time of the whole batch per round.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

import stowlm  # noqa: E402
from stowlm.specbench import heading, measure, table  # noqa: E402

CODE = '''import json


def load_orders(path):
    with open(path) as f:
        return json.load(f)


def order_total(order, tax_rate):
    total = 0
    for line in order["lines"]:
        price = line["price"] * line["quantity"]
        if line.get("discount"):
            price = price - price * line["discount"]
        total = total + price
    return round(total + total * tax_rate, 2)


def summarize(orders, tax_rate):
    totals = [order_total(o, tax_rate) for o in orders]
    return {"count": len(totals), "sum": sum(totals), "max": max(totals) if totals else 0}
'''

def _edit(task: str) -> str:
    return f"```python\n{CODE}```\n\n{task} Show the whole updated code."


PROMPTS = [
    {"name": "rename", "kind": "edit", "content": _edit("Rename the function order_total to compute_order_total.")},
    {"name": "type hints", "kind": "edit", "content": _edit("Add type hints to every function.")},
    {"name": "docstrings", "kind": "edit", "content": _edit("Add a docstring to every function.")},
    {"name": "port to JS", "kind": "edit",
     "content": f"```python\n{CODE}```\n\nPort this code to JavaScript (Node.js)."},
    {"name": "question 1", "kind": "open", "content": "Explain how a hash map works, in a few paragraphs."},
    {"name": "question 2", "kind": "open", "content": "What are the pros and cons of remote work?"},
    {"name": "question 3", "kind": "open", "content": "Write a short story about a lighthouse keeper."},
]


def concurrent(a, prompts) -> int:
    kw = dict(n_ctx=a.concurrent * 2048, n_seq=a.concurrent, n_threads=a.threads, progress=False)
    llms = {"plain": stowlm.LLM(a.model, **kw),
            "spec": stowlm.LLM(a.model, speculative=a.spec, draft_max=a.draft_max, draft_lookup=a.draft_lookup, **kw)}
    msgs = [[{"role": "user", "content": p["content"]}] for p in prompts[:a.concurrent]]
    walls, texts = {"plain": [], "spec": []}, {}
    for r in range(a.rounds):
        for label in (("plain", "spec") if r % 2 == 0 else ("spec", "plain")):
            t = time.perf_counter()
            runs = [llms[label].chat(m, max_tokens=a.n, temperature=0, stream=True) for m in msgs]
            for run_ in runs:
                for _ in run_:
                    pass
            walls[label].append(time.perf_counter() - t)
            texts[label] = [run_.completion.tokens for run_ in runs]
            print(f"round {r + 1} {label:<5} {walls[label][-1]:.2f} s", flush=True)
    same = texts["plain"] == texts["spec"]
    mp, ms = statistics.median(walls["plain"]), statistics.median(walls["spec"])
    print(f"{a.concurrent} requests at once, {a.n} tokens each: plain {mp:.2f} s, spec {ms:.2f} s (median of "
          f"{a.rounds}), plain / spec {mp / ms:.2f}x, identical: {'yes' if same else 'NO'}")
    return 0 if same else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--spec", default="ngram", help="ngram, or a draft model (.gguf path or name)")
    ap.add_argument("--draft-max", type=int, default=None)
    ap.add_argument("--no-draft-lookup", dest="draft_lookup", action="store_false",
                    help="a draft model's drafts alone (default: prompt lookup beside it)")
    ap.add_argument("-n", type=int, default=400, help="max tokens per answer")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--prompts", default=None, help="JSON file of prompts (see the docstring)")
    ap.add_argument("--concurrent", type=int, default=0, metavar="N", help="the first N prompts at once")
    a = ap.parse_args()
    prompts = json.loads(Path(a.prompts).read_text()) if a.prompts else PROMPTS
    if a.concurrent:
        return concurrent(a, prompts)
    kw = dict(n_ctx=4096, n_threads=a.threads, progress=False)
    plain = stowlm.LLM(a.model, **kw)
    spec = stowlm.LLM(a.model, speculative=a.spec, draft_max=a.draft_max, draft_lookup=a.draft_lookup, **kw)
    rows = measure(plain, spec, prompts, a.n, a.rounds, log=lambda line: print(line, flush=True))
    print("\n" + heading(plain, spec, a.spec, a.draft_lookup, a.rounds))
    print(table(rows))
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
