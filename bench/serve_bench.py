"""Load on an OpenAI-compatible server over the loopback address: C concurrent clients x R
requests each, streamed, greedy. Reports errors, aggregate generated tokens/s, and the time to
first token (p50, p99); the baseline is the same requests one at a time. Rounds of baseline then
load (--rounds, default 3): the median ratio is the figure, the spread beside it.

    python bench/serve_bench.py -m ~/.cache/stowlm/models/smollm2-135m.gguf --parallel 4
    python bench/serve_bench.py -m ... --peer ~/peers/llama.cpp/build/bin/llama-server

Each server is started here (stowlm serve, and llama-server with the same model, context per slot,
--parallel and threads) and stopped afterwards. A bounded loop on 127.0.0.1 only, not a test.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
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


def stowlm_env() -> dict:
    """The environment for `stowlm serve`: the stowlm this Python imports (an installed package, or
    python/ on PYTHONPATH) first on PYTHONPATH, the checkout's python/ only where it imports none.
    Putting python/ first always ran the checkout's stowlm in place of an installed one."""
    spec = importlib.util.find_spec("stowlm")
    pkg_parent = Path(spec.origin).resolve().parent.parent if spec is not None and spec.origin else REPO / "python"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(pkg_parent), env.get("PYTHONPATH", "")] if p)
    return env


def start_stowlm(model, parallel, n_ctx_slot, threads):
    port = _free_port()
    env = stowlm_env()
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


class _StreamProtocol(asyncio.Protocol):
    """One streamed request on a plain socket, parsed as bytes arrive (HTTP/1.1, chunked or not,
    then server-sent events): 32 clients on the same two cores as the server must cost it as
    little CPU as they can (httpx in 32 threads took 0.5 ms a token, asyncio streams 0.09 ms)."""

    def __init__(self, request: bytes):
        self.request, self.t0 = request, time.perf_counter()
        self.done = asyncio.get_running_loop().create_future()
        self.head, self.status, self.chunked = b"", None, False
        self.raw, self.body, self.ended = b"", b"", False
        self.ttft, self.tokens, self.error, self.errlines = None, 0, None, []

    def connection_made(self, transport):
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes):
        if self.status is None:
            self.head += data
            if b"\r\n\r\n" not in self.head:
                return
            head, data = self.head.split(b"\r\n\r\n", 1)
            self.status = int(head.split(b" ", 2)[1])
            self.chunked = b"transfer-encoding: chunked" in head.lower()
        if not self.chunked:
            self.body += data
        else:
            self.raw += data
            while not self.ended:
                eol = self.raw.find(b"\r\n")
                if eol < 0:
                    break
                size = int(self.raw[:eol].split(b";")[0], 16)
                if size == 0:
                    self.ended = True
                    break
                if len(self.raw) < eol + 4 + size:
                    break
                self.body += self.raw[eol + 2:eol + 2 + size]
                self.raw = self.raw[eol + 4 + size:]
        *lines, self.body = self.body.split(b"\n")
        for line in lines:
            self._line(line.rstrip(b"\r"))
        if self.ended:
            self.transport.close()

    def _line(self, line: bytes):
        if self.status != 200:
            self.errlines.append(line)
            return
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            return
        line = line[6:]
        # only the lines that can matter are parsed: until the first content, errors, the usage
        if self.ttft is None or b'"error"' in line or b'"completion_tokens"' in line:
            d = json.loads(line)
            if "error" in d and self.error is None:
                self.error = str(d["error"])
            if self.ttft is None and d.get("choices") and d["choices"][0].get("delta", {}).get("content"):
                self.ttft = time.perf_counter() - self.t0
            if d.get("usage"):
                self.tokens = d["usage"]["completion_tokens"]

    def connection_lost(self, exc):
        if self.body:
            self._line(self.body.rstrip(b"\r"))
        if not self.done.done():
            self.done.set_result(None)


async def one_request(host: str, port: int, prompt: str, max_tokens: int) -> dict:
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}).encode()
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
    proto = _StreamProtocol(request)
    await asyncio.get_running_loop().create_connection(lambda: proto, host, port)
    await proto.done
    if proto.status != 200:
        return {"error": f"{proto.status} {b' '.join(proto.errlines)[:200]!r}"}
    if proto.error:
        return {"error": proto.error}
    t = time.perf_counter() - proto.t0
    return {"ttft": proto.ttft if proto.ttft is not None else t, "tokens": proto.tokens, "time": t}


def run_load(base: str, clients: int, per_client: int, max_tokens: int) -> dict:
    host, port = base.rsplit("//", 1)[1].split(":")
    port = int(port)

    async def client_loop(ci: int, results: list):
        for k in range(per_client):  # a connection per request (llama-server closes kept-alive ones)
            results.append(await one_request(host, port, PROMPTS[(ci + k) % len(PROMPTS)] + f" (#{ci}.{k})",
                                             max_tokens))

    async def load():
        await one_request(host, port, "Hello", 4)  # warm-up, not counted
        results = []
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(ci, results) for ci in range(clients)))
        return results, time.perf_counter() - t0

    cpu0 = time.process_time()
    results, wall = asyncio.run(load())
    client_cpu = time.process_time() - cpu0
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    ttfts = sorted(r["ttft"] for r in ok)
    toks = sum(r["tokens"] for r in ok)

    def pct(p):
        return ttfts[min(len(ttfts) - 1, int(round(p / 100 * (len(ttfts) - 1))))] if ttfts else float("nan")

    return {"requests": len(results), "errors": len(errors), "first_error": errors[0] if errors else None,
            "tokens": toks, "wall_s": round(wall, 2), "tokens_per_s": round(toks / wall, 1),
            "ttft_p50_s": round(pct(50), 3), "ttft_p99_s": round(pct(99), 3),
            "client_cpu_ms_per_token": round(1e3 * client_cpu / max(toks, 1), 3)}


def measure(name, start, args) -> dict:
    """Rounds of (one at a time, then the load), each on a fresh server: the ratio of a round
    compares runs a few seconds apart, and the median over rounds is the figure."""
    out = {"rounds": []}
    for rnd in range(args.rounds):
        got = {}
        for parallel, clients, per in ((1, 1, args.baseline_requests), (args.parallel, args.clients, args.requests)):
            proc, base = start(parallel)
            try:
                _wait_ready(base, proc)
                got[f"parallel {parallel}, {clients} client(s) x {per}"] = r = run_load(base, clients, per,
                                                                                       args.max_tokens)
                print(f"{name:10s} round {rnd + 1} --parallel {parallel}: {clients} x {per}: {r}", flush=True)
            finally:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        single, loaded = got.values()
        got["speedup"] = round(loaded["tokens_per_s"] / single["tokens_per_s"], 2)
        out["rounds"].append(got)
    speedups = [g["speedup"] for g in out["rounds"]]
    out["speedup"] = statistics.median(speedups)
    for key in out["rounds"][0]:
        if key != "speedup":
            out[key] = {m: statistics.median(g[key][m] for g in out["rounds"])
                        for m in ("tokens_per_s", "ttft_p50_s", "ttft_p99_s")}
            out[key]["errors"] = sum(g[key]["errors"] for g in out["rounds"])
    print(f"{name:10s} aggregate tokens/s with --parallel {args.parallel} over one at a time: median {out['speedup']}x "
          f"over {args.rounds} rounds {speedups}; medians {({k: v for k, v in out.items() if k.startswith('parallel')})}",
          flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=4, help="requests per client")
    ap.add_argument("--baseline-requests", type=int, default=16, help="requests one at a time for the baseline")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of baseline then load; the median is reported")
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
