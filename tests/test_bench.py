"""stowlm-bench, the native benchmark: arguments, output formats, the memory report, and that
its timed runs compute what the Python API computes for the same tokens."""
import csv
import io
import json
import re
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import stowlm
from conftest import REPO, get_model, subprocess_env

THREADS = "1"  # one worker: fast and steady on a loaded machine


def bench_exe() -> str:
    """The binary that belongs to the stowlm under test: stowlm/bin of an installed package,
    build/ of a development build (python/ on PYTHONPATH)."""
    pkg = Path(stowlm.__file__).resolve().parent
    candidates = [pkg / "bin" / "stowlm-bench"]
    if pkg == (REPO / "python" / "stowlm").resolve():
        candidates.append(REPO / "build" / "stowlm-bench")
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which("stowlm-bench")
    if found:
        return found
    raise AssertionError(f"stowlm-bench not found (looked at {[str(c) for c in candidates]} and PATH)")


def bench(*args, check=True):
    r = subprocess.run([bench_exe(), *map(str, args)], capture_output=True, text=True, timeout=120)
    if check:
        assert r.returncode == 0, f"stowlm-bench {' '.join(map(str, args))} failed:\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def small():
    return str(get_model("smollm2-135m"))


@pytest.fixture(scope="module")
def gguf_facts(small):
    """Tensor bytes, parameter count and KV geometry of the small model from the gguf package."""
    import gguf

    r = gguf.GGUFReader(small)
    f = {k: v.parts[-1][0] for k, v in r.fields.items() if len(v.parts[-1]) == 1}
    return dict(size=sum(int(t.n_bytes) for t in r.tensors),
                n_params=sum(int(t.n_elements) for t in r.tensors),
                n_layer=int(f["llama.block_count"]), n_head_kv=int(f["llama.attention.head_count_kv"]),
                head_dim=int(f["llama.embedding_length"]) // int(f["llama.attention.head_count"]),
                file_bytes=os.path.getsize(small))


@pytest.fixture(scope="module")
def json_run(small, tmp_path_factory):
    """One run covering pp, tg, depth and repetitions: the JSON report and the dumped logits."""
    dump = tmp_path_factory.mktemp("bench") / "logits.json"
    r = bench("-m", small, "-p", 16, "-n", 4, "-d", 8, "-r", 2, "-t", THREADS, "-o", "json",
              "--seed", 7, "--dump-logits", dump)
    return json.loads(r.stdout), json.loads(dump.read_text())


def test_help():
    r = bench("--help")
    assert "usage: stowlm-bench" in r.stdout
    for flag in ("-p", "-n", "-d", "-t", "-r", "-ub", "-ctk", "-o", "-v"):
        assert f"  {flag}" in r.stdout


def test_json_fields(json_run, small, gguf_facts):
    results, _ = json_run
    assert [(x["n_prompt"], x["n_gen"], x["n_depth"]) for x in results] == [(16, 0, 8), (0, 4, 8)]
    for x in results:
        assert x["model_filename"] == small
        assert x["model_type"].startswith("llama ")
        assert x["model_size"] == gguf_facts["size"]
        assert x["model_n_params"] == gguf_facts["n_params"]
        assert x["n_threads"] == int(THREADS) and x["n_ubatch"] == 512 and x["type_k"] == "f16"
        assert x["backends"] == "CPU"
        assert len(x["samples_ns"]) == len(x["samples_ts"]) == 2
        tokens = x["n_prompt"] + x["n_gen"]
        ts = [tokens * 1e9 / ns for ns in x["samples_ns"]]
        np.testing.assert_allclose(x["samples_ts"], ts, rtol=1e-5)
        np.testing.assert_allclose(x["avg_ts"], np.mean(ts), rtol=1e-5)
        np.testing.assert_allclose(x["stddev_ts"], np.std(ts, ddof=1), rtol=1e-4, atol=1e-6)
        assert x["avg_ns"] == pytest.approx(np.mean(x["samples_ns"]), abs=1)


def test_bench_logits_match_python_api(json_run, small):
    """The last logits of each test's final repetition (after warm-up and earlier repetitions
    truncated the cache back to the depth) equal a fresh Python context fed the same tokens the
    same way: the prompt in one call, generated tokens one call each."""
    from stowlm.engine import Context, Model

    _, dump = json_run
    assert dump["seed"] == 7 and len(dump["runs"]) == 2
    model = Model(small, devices=[f"cpu[threads={THREADS}]"])
    for run in dump["runs"]:
        n_p, n_g = run["n_prompt"], run["n_gen"]
        depth = run["depth_tokens"]
        toks = run["tokens"]
        assert run["test"].endswith(" @ d8") and len(depth) == 8 and len(toks) == n_p + n_g
        assert all(0 <= t < model.n_vocab for t in depth + toks)
        ctx = Context(model, n_ctx=len(depth) + len(toks), n_ubatch=512, n_outputs=1)
        if depth:
            ctx.eval(depth)
        if n_p:
            want = ctx.eval(toks[:n_p])
        for t in toks[n_p:]:
            want = ctx.eval([t])
        got = np.asarray(run["logits"], dtype=np.float32)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4, err_msg=run["test"])
        if depth:
            # the depth tokens are really in the cache: without them the logits differ
            ctx = Context(model, n_ctx=len(toks), n_ubatch=512, n_outputs=1)
            if n_p:
                alone = ctx.eval(toks[:n_p])
            for t in toks[n_p:]:
                alone = ctx.eval([t])
            assert np.abs(alone - got).max() > 0.1, run["test"]


def test_markdown_and_csv(small):
    md = bench("-m", small, "-p", 8, "-n", 2, "-r", 1, "-t", THREADS, "--no-warmup").stdout.splitlines()
    head = [c.strip() for c in md[0].strip("|").split("|")]
    assert head == ["model", "size", "params", "backend", "threads", "test", "t/s"]
    assert all(re.fullmatch(r"-+:?", c.strip()) for c in md[1].strip("|").split("|"))
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in md[2:]]
    assert [r[5] for r in rows] == ["pp8", "tg2"]
    for r in rows:
        assert r[1].endswith(" MiB") and r[2] == "134.52 M" and r[4] == THREADS
        mean, std = r[6].split(" ± ")
        assert float(mean) > 0 and float(std) == 0  # one repetition: no spread

    out = bench("-m", small, "-p", 8, "-n", 0, "-r", 1, "-t", THREADS, "-ub", 4, "-d", 4, "-o", "csv",
                "--no-warmup").stdout
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == 1
    for key in ("model_filename", "model_type", "model_size", "model_n_params", "n_threads", "n_prompt",
                "n_gen", "n_depth", "n_ubatch", "avg_ts", "stddev_ts", "samples_ts"):
        assert key in rows[0]
    assert (rows[0]["n_prompt"], rows[0]["n_gen"], rows[0]["n_depth"], rows[0]["n_ubatch"]) == ("8", "0", "4", "4")
    assert float(rows[0]["avg_ts"]) > 0


@pytest.mark.parametrize("ctk,bytes_per_32", [("f16", 64), ("q8_0", 34)])
def test_verbose_memory_report(small, gguf_facts, ctk, bytes_per_32):
    r = bench("-m", small, "-p", 16, "-n", 0, "-r", 1, "-t", THREADS, "-ctk", ctk, "-v", "--no-warmup")
    lines = r.stderr.splitlines()
    dev = [ln.split() for ln in lines if ln.strip().startswith("cpu:0")]
    assert len(dev) == 1
    vals = dict(zip(dev[0][1::3], map(float, dev[0][2::3])))
    # K and V of every layer for n_ctx = 16 cells
    g = gguf_facts
    kv = 2 * g["n_layer"] * 16 * g["n_head_kv"] * g["head_dim"] // 32 * bytes_per_32
    assert vals["kv"] == pytest.approx(kv / 2**20, abs=0.006)
    assert vals["weights"] == pytest.approx(g["size"] / 2**20, abs=0.006)
    assert vals["compute"] > 0
    assert vals["total"] == pytest.approx(vals["weights"] + vals["kv"] + vals["compute"], abs=0.02)
    peak = [ln for ln in lines if ln.startswith("peak RSS")]
    assert len(peak) == 1
    rss = float(peak[0].split()[2])
    # every weight page is read by the run, so the resident peak holds at least the weights
    assert rss >= vals["weights"]
    assert f"file {g['file_bytes'] / 2**20:.2f}" in peak[0]


def test_verbose_generation_bandwidth(small, gguf_facts):
    """-v states the weight bytes a generated token reads (smollm2's output is its embedding, so
    every tensor once) and the rate that makes at the measured tokens/s."""
    r = bench("-m", small, "-p", 0, "-n", 4, "-r", 2, "-t", THREADS, "-o", "json", "-v", "--no-warmup")
    row = json.loads(r.stdout)[0]
    line = [ln for ln in r.stderr.splitlines() if "MB of weights per token" in ln]
    assert len(line) == 1 and line[0].strip().startswith("tg4:")
    words = line[0].split()
    mb, gbs = float(words[1]), float(words[-2])
    assert mb == pytest.approx(gguf_facts["size"] / 1e6, abs=0.06)
    assert gbs == pytest.approx(mb * float(row["avg_ts"]) / 1e3, rel=0.02, abs=0.06)


def test_verbose_times_the_cpu_ops(small):
    """-v times a CPU device's ops in one more run: every product is named by weights the file
    holds (the gguf package's names, layer prefix dropped), one call a token for the output, one
    per layer for the others, and the ops' times add up to about a token's."""
    import gguf

    names = {re.sub(r"^blk\.\d+\.", "", t.name) for t in gguf.GGUFReader(small).tensors}
    n_layer = stowlm.Model(small).n_layer
    r = bench("-m", small, "-p", 0, "-n", 4, "-r", 2, "-t", THREADS, "-v", "--no-warmup")
    head = [ln for ln in r.stderr.splitlines() if re.match(r"\s+tg4 on cpu:0: [\d.]+ ms per token", ln)]
    assert len(head) == 1, r.stderr
    per_token, in_ops = map(float, re.findall(r"([\d.]+) ms", head[0]))
    rows = {m.group(1): (float(m.group(2)), float(m.group(3))) for m in
            (re.match(r"\s{4}(\S+)\s+([\d.]+) ms\s+[\d.]+%\s+([\d.]+) calls", ln) for ln in r.stderr.splitlines()) if m}
    products = [k for k in rows if k.endswith(".weight") or "+" in k]
    assert products and all(part in names for k in products for part in k.split("+")), rows
    assert rows["output.weight" if "output.weight" in names else "token_embd.weight"][1] == 1.0
    # (an op under 0.5% of the ops' time is not listed: attention over 4 cells may not be, on a busy machine)
    assert rows["ffn_down.weight"][1] == n_layer and rows.get("flash_attn", (0, n_layer))[1] == n_layer
    assert sum(ms for ms, _ in rows.values()) <= in_ops * 1.001 and 0.2 * per_token < in_ops < 5 * per_token


@pytest.mark.parametrize("how", [["-ot", "ffn_(gate|up|down)_exps=cpu:0"], ["--n-cpu-moe", "2"]])
def test_expert_overrides_put_the_experts_where_asked(model_path, how):
    """-ot (matched anywhere in a name, as llama-bench's) and --n-cpu-moe (the first N layers'
    experts on the first CPU device): with every layer on cpu:1, cpu:0 holds exactly the expert
    tensors asked for, by the gguf package's byte counts."""
    import gguf

    path = str(model_path("qwen3moe-tiny"))
    r = bench("-m", path, "-dev", "cpu:0[threads=1],cpu:1[threads=1]", "--layer-split", "0,4", *how,
              "-p", 8, "-n", 0, "-r", 1, "-v", "--no-warmup")
    rows = {ln.split()[0]: dict(zip(ln.split()[1::3], map(float, ln.split()[2::3])))
            for ln in r.stderr.splitlines() if ln.strip().startswith("cpu:")}
    layers = None if how[0] == "-ot" else {0, 1}
    want = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors
               if "_exps" in t.name and (layers is None or int(t.name.split(".")[1]) in layers))
    assert want > 0
    assert rows["cpu:0"]["weights"] == pytest.approx(want / 2**20, abs=0.006)


@pytest.mark.parametrize("args,code,message", [
    ([], 2, "no model given"),
    (["--frobnicate"], 2, "unknown argument '--frobnicate'"),
    (["-m", "/nonexistent/model.gguf"], 1, "model file '/nonexistent/model.gguf' does not exist"),
    (["-m", "{small}", "-p", "abc"], 2, "-p: expected an integer, got 'abc'"),
    (["-m", "{small}", "-n", "-3"], 2, "-n: must be >= 0"),
    (["-m", "{small}", "-r", "0"], 2, "-r: must be >= 1"),
    (["-m", "{small}", "-t"], 2, "-t: missing value"),
    (["-m", "{small}", "-o", "xml"], 2, "-o: unknown format 'xml'"),
    (["-m", "{small}", "-ctk", "q4_0"], 2, "-ctk: unknown KV cache type 'q4_0'"),
    (["-m", "{small}", "-pg", "512"], 2, "-pg: expected P,G"),
    (["-m", "{small}", "-p", "0", "-n", "0"], 2, "nothing to run"),
    (["-m", "{garbage}"], 1, "garbage.gguf"),
    (["-m", "{small}", "-dev", "tpu:0"], 2, "-dev: device 'tpu:0': unknown kind 'tpu'"),
    (["-m", "{small}", "-dev", "cpu:0[color=red]"], 2, "-dev: device 'cpu:0[color=red]': unknown option 'color'"),
    (["-m", "{small}", "-ot", "exps"], 2, "-ot: expected REGEX=DEVICE, got 'exps'"),
    (["-m", "{small}", "-ot", "exps=cuda:3"], 2, "-ot exps=cuda:3: no device 'cuda:3' in -dev"),
    (["-m", "{small}", "--moe-offload-min", "-1"], 2, "--moe-offload-min: must be >= 0"),
])
def test_bad_arguments(small, tmp_path, args, code, message):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + b"\xff" * 60)
    r = bench(*[a.format(small=small, garbage=garbage) for a in args], check=False)
    assert r.returncode == code, r.stderr
    assert message in r.stderr
    assert r.stderr.startswith("stowlm-bench: error: ")
    assert r.stdout == ""


def test_device_grammar_is_the_packages(small):
    """stowlm-bench reads device lists with the core's grammar, the one stowlm.devices uses:
    the options fit knows (speed=) parse here too instead of drifting apart."""
    from stowlm import _core

    spec = "cpu:0[threads=1,speed=2,mem=1GiB]"
    assert _core.engine.parse_device(spec) == ("cpu", 0, 1, 1 << 30, -1, 2.0)
    r = bench("-m", str(small), "-dev", spec, "-p", "8", "-n", "0", "-r", "1", check=False)
    assert r.returncode == 0, r.stderr
    r = bench("-m", str(small), "-dev", "cpu:0,cpu:0[mem=1GiB]", "-p", "8", "-n", "0", "-r", "1", check=False)
    assert r.returncode == 2 and "-dev: devices: cpu:0 appears more than once" in r.stderr, r.stderr


def test_cuda_device_without_a_gpu(small):
    from conftest import cuda_skip_reason

    if cuda_skip_reason() is None:
        pytest.skip("this machine has a CUDA device")
    r = bench("-m", str(small), "-dev", "cuda:0", "-p", "8", "-n", "0", "-r", "1", check=False)
    assert r.returncode == 1 and "no CUDA device is present" in r.stderr and "cuda:0" in r.stderr, r.stderr


def test_stowlm_bench_subcommand():
    """`stowlm bench ARGS` hands its arguments to the binary (found on PATH here)."""
    env = subprocess_env()
    env["PATH"] = os.pathsep.join([str(Path(bench_exe()).parent), env.get("PATH", "")])
    r = subprocess.run([sys.executable, "-m", "stowlm", "bench", "-m", "/nonexistent.gguf"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "stowlm-bench: error: model file '/nonexistent.gguf' does not exist" in r.stderr


def test_compare_script(small, tmp_path):
    """bench/compare.py with stowlm-bench standing in as the peer (same flags, same JSON): one
    row per test, and the ratio column is the quotient of the two t/s columns."""
    raw = tmp_path / "raw.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "compare.py"), "--stowlm", bench_exe(),
                        "--peer", f"twin={bench_exe()}", "--peer-args", "", "-m", small, "-p", "8", "-n", "2",
                        "-t", THREADS, "-r", "1", "--json", str(raw)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("|")]
    assert [c.strip() for c in lines[0].strip("|").split("|")] == ["model", "test", "stowlm t/s", "twin t/s",
                                                                     "stowlm/twin"]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    assert [(row[0], row[1]) for row in rows] == [("smollm2-135m", "pp8"), ("smollm2-135m", "tg2")]
    for row in rows:
        ours, theirs = float(row[2].split(" ± ")[0]), float(row[3].split(" ± ")[0])
        assert float(row[4]) == pytest.approx(ours / theirs, abs=0.006)
    calls = json.loads(raw.read_text())
    assert [c["tool"] for c in calls] == ["stowlm", "twin", "stowlm", "twin"]  # alternating
    assert all(c["n_threads"] == int(THREADS) for c in calls)
    assert not any("-d" in c["command"] for c in calls)  # depth 0 unsaid: ik_llama.cpp's llama-bench refuses -d


def test_serve_bench_starts_the_stowlm_it_imports_not_the_checkouts(tmp_path):
    """bench/serve_bench.py starts `stowlm serve` with the stowlm its Python imports: an installed
    package (here one on PYTHONPATH) is not shadowed by the checkout's python/."""
    site = tmp_path / "site"
    (site / "stowlm").mkdir(parents=True)
    (site / "stowlm" / "__init__.py").write_text("")  # stands in for an installed stowlm
    script = "\n".join([
        "import subprocess, sys, types",
        f"sys.path.insert(0, {str(REPO / 'bench')!r})",
        "import serve_bench",
        "seen = {}",
        "serve_bench.subprocess = types.SimpleNamespace(DEVNULL=subprocess.DEVNULL,",
        "                                               Popen=lambda cmd, env=None, **kw: seen.update(env=env))",
        "serve_bench.start_stowlm('model.gguf', 1, 256, None)",
        "r = subprocess.run([sys.executable, '-c', 'import stowlm; print(stowlm.__file__)'], env=seen['env'],",
        "                   capture_output=True, text=True)",
        "print(r.stdout.strip())"])
    env = dict(os.environ, PYTHONPATH=str(site))
    r = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).resolve() == (site / "stowlm" / "__init__.py").resolve(), r.stdout
