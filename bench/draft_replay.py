"""A draft model's drafting replayed without timing noise: how often its greedy token is the
model's (teacher-forced over the model's own greedy answers), how well its confidence says so, and
the tokens per unit of time that the Speculator's policy would reach, in one-token steps of the
model, for given draft step costs.

    python bench/draft_replay.py -m qwen2.5-coder-0.5b --spec draft.gguf
    python bench/draft_replay.py --spec draft.gguf --cost 0.45,0.55 --chain 0.6,0.85,0.95

spec_bench.py measures the same prompts' real speed, but on a VM whose memory bandwidth moves by
10-15% between minutes a policy's 5% is lost in it; here every policy sees the same drafts. The
replay is exact while a draft is right (the draft's context is then the model's text); past a
miss it reads the draft's confidence at the model's text instead of at its own wrong token.
A pass of n tokens costs PassCosts.cost(n) steps; a draft step `--cost` steps (stowlm-bench's tg of
the draft over the model's: qwen2.5-coder-0.5b's default draft 0.46-0.52 on two Zen 4 cores).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

import stowlm  # noqa: E402
from stowlm import speculative  # noqa: E402

from spec_bench import PROMPTS  # noqa: E402


def teacher_forced(target, draft, prompt, answer):
    """(the draft's top probability, whether its top token is the model's) at each answer token."""
    drafter = speculative.ModelDrafter(draft)
    drafter.follow(target)
    tokens = list(prompt) + list(answer)
    logits = draft.logits(drafter._ids(tokens))[len(prompt) - 1:len(tokens) - 1]
    z = np.exp(logits - logits.max(-1, keepdims=True))
    top = (z.max(-1) / z.sum(-1)).astype(np.float64)
    pick = logits.argmax(-1)
    if drafter.to_target is not None:
        pick = drafter.to_target[pick]
    return top, pick == np.asarray(answer)


class _Replay:
    """A draft model that drafts from the recorded confidence, ending its drafts by ModelDrafter's
    rule (speculative.chain_holds)."""
    cheap = False

    def __init__(self, top, seconds):
        self.top, self.seconds, self.at = top, seconds, 0

    def draft(self, history, k):
        out, chain = [], 1.0
        while len(out) < k and self.at + len(out) < len(self.top):
            chain *= self.top[self.at + len(out)]
            out.append(0)
            if not speculative.chain_holds(chain):
                break
        return out, "model"


def replay(top, kept, cost: float, draft_max: int, repacked: bool = True) -> float:
    """Tokens per one-token step of the model that the Speculator's drafts would yield."""
    costs = speculative.PassCosts(repacked=repacked)
    costs.observe(1, 1.0)
    drafter = _Replay(top, cost)
    spec = speculative.Speculator(drafter, draft_max, costs)
    at, tokens, steps = 0, 0, 0.0
    while at < len(top):
        drafter.at = at
        d = spec.draft([0] * (at + 1), draft_max)
        n = 0
        while n < len(d) and kept[at + n]:
            n += 1
        spec.record(len(d), n)
        got = min(n + 1, len(top) - at)
        tokens, at = tokens + got, at + got
        steps += len(d) * cost + costs.cost(len(d) + 1)
    return tokens / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--spec", required=True, help="the draft model (.gguf path or name)")
    ap.add_argument("-n", type=int, default=150, help="answer tokens per prompt")
    ap.add_argument("--prompts", default=None, help="JSON file of prompts (spec_bench.py's format; default its edits)")
    ap.add_argument("--cost", default="0.45,0.55", help="a draft step's cost in model steps, comma-separated")
    ap.add_argument("--chain", default=None, help="P_CHAIN values to replay, comma-separated (default the module's)")
    ap.add_argument("--draft-max", type=int, default=speculative.DRAFT_MAX)
    ap.add_argument("-t", "--threads", type=int, default=None)
    a = ap.parse_args()
    prompts = json.loads(Path(a.prompts).read_text()) if a.prompts else [p for p in PROMPTS if p["kind"] == "edit"]
    kw = dict(n_ctx=4096, n_threads=a.threads, progress=False)
    target, draft = stowlm.LLM(a.model, **kw), stowlm.LLM(a.spec, **kw)
    runs = []
    for p in prompts:
        msgs = [{"role": "user", "content": p["content"]}]
        answer = target.chat(msgs, max_tokens=a.n, temperature=0).tokens
        runs.append((p["name"],) + teacher_forced(target, draft, target.chat_tokens(msgs), answer))
    print("| prompt | tokens | draft's token is the model's |\n| --- | ---: | ---: |")
    for name, top, kept in runs:
        print(f"| {name} | {len(top)} | {kept.mean():.3f} |")
    top, kept = np.concatenate([r[1] for r in runs]), np.concatenate([r[2] for r in runs])
    print("\n| draft's probability | tokens | the model's |\n| --- | ---: | ---: |")
    edges = [0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.01]
    for lo, hi in zip(edges, edges[1:]):
        m = (top >= lo) & (top < hi)
        print(f"| {lo:.2f}-{min(hi, 1):.2f} | {m.sum()} | {kept[m].mean() if m.any() else float('nan'):.2f} |")
    chains = [float(x) for x in a.chain.split(",")] if a.chain else [speculative.P_CHAIN]
    print("\n| P_CHAIN | draft step | " + " | ".join(r[0] for r in runs) + " | geometric mean |")
    print("| --- | ---: |" + " ---: |" * (len(runs) + 1))
    for chain in chains:
        speculative.P_CHAIN = chain
        for cost in (float(x) for x in a.cost.split(",")):
            ratios = [replay(t, k, cost, a.draft_max) for _, t, k in runs]
            print(f"| {chain} | {cost} | " + " | ".join(f"{r:.2f}x" for r in ratios) +
                  f" | {statistics.geometric_mean(ratios):.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
