"""Decode speed with a JSON schema against the same request without one, alone and with every
slot busy: the grammar's masks must not slow generation or serialise the batch.

    python bench/structured_bench.py -m ~/.cache/stowlm/models/qwen2.5-coder-0.5b.gguf --rounds 5

One LLM with --slots sequences (the batch engine, as the server runs it). Each round runs, in
alternating order, 1 then `slots` concurrent requests of N generated tokens, unconstrained (end
tokens banned so it runs N tokens) and with a schema whose shortest answer is longer than N
(so the grammar keeps going). Decode tokens/s = tokens after the first / time after the first, per
request alone, summed over the requests when busy. The figure is the median ratio over rounds.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

import stowlm  # noqa: E402

SCHEMA = {"type": "array", "minItems": 60, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                     "city": {"type": "string", "maxLength": 16},
                                     "likes": {"type": "array", "items": {"enum": ["tea", "code", "maps", "jazz"]},
                                               "maxItems": 3}},
    "required": ["name", "age", "city", "likes"]}}
PROMPTS = ["List people as JSON: name, age, city and what they like.", "Write a JSON array of fictional people.",
           "Give me JSON about many people.", "People, as a JSON list of objects."]


def _run(llm, prompt: str, n: int, constrained: bool, out: list) -> None:
    kw = {"json_schema": SCHEMA} if constrained else {"logit_bias": {t: -math.inf for t in llm.tokenizer.eog_ids}}
    msgs = [{"role": "user", "content": prompt}]
    it = llm.chat(msgs, max_tokens=n, temperature=0, stream=True, **kw)
    first = last = None
    for _ in it:
        last = time.perf_counter()
        first = first or last
    c = it.completion
    assert c.completion_tokens == n and c.finish_reason == "length", (constrained, c.completion_tokens, c.finish_reason)
    out.append((c.completion_tokens - 1, last - first, first, last))


def _measure(llm, n: int, k: int, constrained: bool) -> float:
    """Decode tokens/s of k concurrent requests (summed: tokens over the span they all decoded)."""
    res: list = []
    threads = [threading.Thread(target=_run, args=(llm, PROMPTS[i % len(PROMPTS)], n, constrained, res))
               for i in range(k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if k == 1:
        return res[0][0] / res[0][1]
    return sum(r[0] for r in res) / (max(r[3] for r in res) - min(r[2] for r in res))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("-n", type=int, default=128, help="tokens per request")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=None)
    a = ap.parse_args()
    with stowlm.LLM(a.model, n_seq=a.slots, n_ctx=a.slots * 1024, n_threads=a.threads, progress=False) as llm:
        _measure(llm, 16, 1, True)  # warm-up: builds llguidance's view of the vocabulary (once per model)
        ratios = {1: [], a.slots: []}
        for r in range(a.rounds):
            for k in (1, a.slots):
                order = (False, True) if r % 2 == 0 else (True, False)
                got = {c: _measure(llm, a.n, k, c) for c in order}
                ratios[k].append(got[True] / got[False])
                print(f"round {r + 1}  {k} request(s): free {got[False]:7.1f} t/s  schema {got[True]:7.1f} t/s  "
                      f"ratio {ratios[k][-1]:.3f}", flush=True)
        for k, rs in ratios.items():
            print(f"{Path(str(llm.path)).name}: schema / free decode, {k} request(s): median {statistics.median(rs):.3f} "
                  f"(rounds {', '.join(f'{x:.3f}' for x in rs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
