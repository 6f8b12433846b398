"""Load on an OpenAI-compatible server over the loopback address: C concurrent clients x R
requests each, streamed, greedy. Reports errors, aggregate generated tokens/s, and the time to
first token (p50, p99); the baseline is the same requests one at a time.

    python bench/serve_bench.py -m ~/.cache/stowlm/models/smollm2-135m.gguf --parallel 4
    python bench/serve_bench.py -m ... --peer ~/peers/llama.cpp/build/bin/llama-server

Each server is started here (stowlm serve, and llama-server with the same model, context per slot,
--parallel and threads) and stopped afterwards. A bounded loop on 127.0.0.1 only, not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["Write a short story about a robot who learns to paint.", "Explain how a rainbow forms.",
           "List five uses of a paperclip.", "What is the capital of Australia and why?",
           "Describe the water cycle for a child.", "Give three tips for learning a language.",
           "Why is the sky blue?", "Summarise the plot of a heist film you invent."]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(base: str, proc, timeout=300.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("the server did not become ready")


def start_stowlm(model, parallel, n_ctx_slot, threads):
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "stowlm", "serve", model, "--port", str(port), "--parallel", str(parallel),
           "-c", str(n_ctx_slot * parallel), "-q", "--max-queue", "256"]
    if threads:
        cmd += ["-t", str(threads)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def start_llama(binary, model, parallel, n_ctx_slot, threads):
    port = _free_port()
    cmd = [binary, "-m", model, "--port", str(port), "--host", "127.0.0.1", "--parallel", str(parallel),
           "-c", str(n_ctx_slot * parallel), "--no-webui"]
    if threads:
        cmd += ["-t", str(threads), "-tb", str(threads)]
    env = dict(os.environ, LD_LIBRARY_PATH=str(Path(binary).parent) + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""))
    log = open(f"/tmp/serve_bench_llama_{parallel}.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def one_request(client: httpx.Client, base: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            return {"error": f"{r.status_code} {r.text[:200]}"}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if "error" in d:
                return {"error": str(d["error"])}
            if d.get("choices") and d["choices"][0].get("delta", {}).get("content") and ttft is None:
                ttft = time.perf_counter() - t0
            if d.get("usage"):
                tokens = d["usage"]["completion_tokens"]
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0, "tokens": tokens,
            "time": time.perf_counter() - t0}


def run_load(base: str, clients: int, per_client: int, max_tokens: int) -> dict:
    results, lock = [], threading.Lock()

    def client_loop(ci: int):
        for k in range(per_client):
            # a connection per request: llama-server closes a kept-alive one after a few requests
            with httpx.Client(timeout=600) as c:
                res = one_request(c, base, PROMPTS[(ci + k) % len(PROMPTS)] + f" (#{ci}.{k})", max_tokens)
            with lock:
                results.append(res)

    # warm-up: one request, not counted
    with httpx.Client(timeout=600) as c:
        one_request(c, base, "Hello", 4)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as ex:
        list(ex.map(client_loop, range(clients)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    ttfts = sorted(r["ttft"] for r in ok)
    toks = sum(r["tokens"] for r in ok)

    def pct(p):
        return ttfts[min(len(ttfts) - 1, int(round(p / 100 * (len(ttfts) - 1))))] if ttfts else float("nan")

    return {"requests": len(results), "errors": len(errors), "first_error": errors[0] if errors else None,
            "tokens": toks, "wall_s": round(wall, 2), "tokens_per_s": round(toks / wall, 1),
            "ttft_p50_s": round(pct(50), 3), "ttft_p99_s": round(pct(99), 3)}


def measure(name, start, args) -> dict:
    out = {}
    for parallel, clients, per in ((1, 1, args.baseline_requests), (args.parallel, args.clients, args.requests)):
        proc, base = start(parallel)
        try:
            _wait_ready(base, proc)
            out[f"parallel {parallel}, {clients} client(s) x {per}"] = r = run_load(base, clients, per, args.max_tokens)
            print(f"{name:10s} --parallel {parallel}: {clients} x {per}: {r}", flush=True)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    (single, loaded) = out.values()
    out["speedup"] = round(loaded["tokens_per_s"] / single["tokens_per_s"], 2)
    print(f"{name:10s} aggregate tokens/s with --parallel {args.parallel} over one at a time: {out['speedup']}x",
          flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=4, help="requests per client")
    ap.add_argument("--baseline-requests", type=int, default=8, help="requests one at a time for the baseline")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ctx-slot", type=int, default=1024, help="context per slot")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--peer", default=None, help="llama-server binary to run the same load against")
    ap.add_argument("--no-stowlm", action="store_true", help="measure the peer only")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    with open("/proc/cpuinfo") as f:
        cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "?")
    print(f"CPU: {cpu}, {os.cpu_count()} cores; model {os.path.basename(args.model)}; "
          f"{args.clients} clients x {args.requests} requests, max_tokens {args.max_tokens}", flush=True)
    res = {"cpu": cpu}
    if not args.no_stowlm:
        res["stowlm"] = measure("stowlm", lambda p: start_stowlm(args.model, p, args.ctx_slot, args.threads), args)
    if args.peer:
        res["llama-server"] = measure("llama.cpp", lambda p: start_llama(args.peer, args.model, p, args.ctx_slot,
                                                                        args.threads), args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
