"""Generation through the Python API (LLM.generate, streamed), tokens/s after the first token,
greedy and sampled: what a user of the package gets, beside stowlm-bench's native tg figure
(the difference is Python's share: sampling, detokenizing, the calls).

    python bench/generate_bench.py -m smollm2-135m -m gemma3-270m -n 128 -t 2
    STOWLM_PY=/other/checkout/python python bench/generate_bench.py ...   # another tree's package, for A/B
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.environ.get("STOWLM_PY", str(Path(__file__).resolve().parent.parent / "python")))

import stowlm  # noqa: E402


def rate(llm, prompt: str, n: int, temperature: float) -> float:
    it = llm.generate(prompt, max_tokens=n, temperature=temperature, seed=1, stream=True)
    first = None
    for _ in it:
        first = first or time.perf_counter()
    return (it.completion.completion_tokens - 1) / (time.perf_counter() - first)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", action="append", help="model name or .gguf path (repeatable)")
    ap.add_argument("-n", type=int, default=128, help="tokens per generation")
    ap.add_argument("--temperatures", default="0,0.8", help="comma-separated (default top_k 40, top_p 0.95)")
    ap.add_argument("-r", "--rounds", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--prompt", default="The history of the Roman Empire")
    a = ap.parse_args()
    temps = [float(t) for t in a.temperatures.split(",")]
    print("| model | temperature | t/s (best of rounds) |\n| --- | ---: | ---: |")
    for m in a.model or ["smollm2-135m"]:
        llm = stowlm.LLM(m, n_ctx=a.n + 64, n_threads=a.threads, progress=False)
        rate(llm, a.prompt, 8, 0.0)  # warm-up
        best = {t: 0.0 for t in temps}
        for _ in range(a.rounds):
            for t in temps:  # alternating, so the machine's drift is shared
                best[t] = max(best[t], rate(llm, a.prompt, a.n, t))
        for t in temps:
            print(f"| {Path(str(llm.path)).stem} | {t} | {best[t]:.1f} |")
        llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
