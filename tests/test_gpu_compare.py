"""bench/gpu_compare.py without a GPU: its parsers on captured outputs of llama-bench (CUDA build,
JSON and markdown) and stowlm-bench, the cuBLAS lookup, the alternation, medians and ratios with
stand-in tools whose samples are known, the refusal of a peer that fell back to the CPU, and one
real run of the stowlm side on the CPU (and of the prebuilt peer on the CPU where it is found)."""
import json
import os
import re
import statistics
import string
import subprocess
import sys
import types
from pathlib import Path

import pytest

from conftest import REPO, get_model

sys.path.insert(0, str(REPO / "bench"))
import gpu_compare  # noqa: E402

# llama-bench -m smollm2-135m.gguf -ngl 99 -fa 1 -p 512 -n 128 -r 3 -o json, CUDA build, stdout: one
# record per test in this layout (its ggml_cuda_init lines go to stderr, but a log line on stdout
# must not break the parse).
LLAMA_RECORD = string.Template("""  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "Intel(R) Xeon(R) Platinum 8480+",
    "gpu_info": "NVIDIA H100 80GB HBM3",
    "backends": "CUDA",
    "model_filename": "/root/.cache/stowlm/models/smollm2-135m.gguf",
    "model_type": "llama 256M Q4_1",
    "model_size": 96576768,
    "model_n_params": 134515008,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 16,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": 99,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": 1,
    "devices": "auto",
    "n_prompt": $n_prompt,
    "n_gen": $n_gen,
    "n_depth": 0,
    "test_time": "2026-11-27T10:02:11Z",
    "avg_ns": $avg_ns,
    "stddev_ns": $stddev_ns,
    "avg_ts": $avg_ts,
    "stddev_ts": $stddev_ts,
    "samples_ns": [ $samples_ns ],
    "samples_ts": [ $samples_ts ]
  }""")
LLAMA_JSON = ("ggml_cuda_init: found 1 CUDA devices:\n"
              "  Device 0: NVIDIA H100 80GB HBM3, compute capability 9.0, VMM: no\n[\n"
              + LLAMA_RECORD.substitute(n_prompt=512, n_gen=0, avg_ns=10468085, stddev_ns=88113, avg_ts=48911.112345,
                                        stddev_ts=411.204511, samples_ns="10400000, 10567890, 10436365",
                                        samples_ts="49230.8, 48449.6, 49059.4") + ",\n"
              + LLAMA_RECORD.substitute(n_prompt=0, n_gen=128, avg_ns=201234567, stddev_ns=1234567, avg_ts=636.12,
                                        stddev_ts=3.91, samples_ns="200000000, 202469134, 201234567",
                                        samples_ts="640.0, 632.2, 636.1") + "\n]\n")

# The same run's default (markdown) output.
LLAMA_MD = """| model                          |       size |     params | backend    | ngl | fa |            test |                  t/s |
| ------------------------------ | ---------: | ---------: | ---------- | --: | -: | --------------: | -------------------: |
| llama 256M Q4_1                |  92.10 MiB |   134.52 M | CUDA       |  99 |  1 |           pp512 |     48911.11 ± 411.20 |
| llama 256M Q4_1                |  92.10 MiB |   134.52 M | CUDA       |  99 |  1 |           tg128 |        636.12 ± 3.91 |

build: 0c1e570 (1)
"""

# stowlm-bench -m smollm2-135m.gguf -dev cuda:0 -p 512 -n 128 -d 0,4096 -r 3 (markdown).
STOWLM_MD = """| model                          |       size |     params | backend  | threads |             test |                  t/s |
| ------------------------------ | ---------: | ---------: | -------- | ------: | ---------------: | -------------------: |
| llama 135M Q4_1                |  92.10 MiB |   134.52 M | CUDA     |      16 |            pp512 |    19560.21 ± 120.33 |
| llama 135M Q4_1                |  92.10 MiB |   134.52 M | CUDA     |      16 |            tg128 |        283.40 ± 1.02 |
| llama 135M Q4_1                |  92.10 MiB |   134.52 M | CUDA     |      16 |    pp512 @ d4096 |     9120.50 ± 33.10 |
| llama 135M Q4_1                |  92.10 MiB |   134.52 M | CUDA     |      16 |    tg128 @ d4096 |        201.77 ± 0.40 |
"""

# stowlm-bench ... -o json (one test of it).
STOWLM_JSON = """[
  {
    "build_commit": "stowlm",
    "cpu_info": "Intel(R) Xeon(R) Platinum 8480+",
    "backends": "CUDA",
    "model_filename": "/root/.cache/stowlm/models/smollm2-135m.gguf",
    "model_type": "llama 135M Q4_1",
    "model_size": 96576768,
    "model_n_params": 134515008,
    "n_ubatch": 512,
    "devices": "cuda:0",
    "n_copies": 1,
    "n_threads": 16,
    "type_k": "f16",
    "type_v": "f16",
    "n_prompt": 0,
    "n_gen": 128,
    "n_depth": 0,
    "test_time": "2026-11-27T10:01:58Z",
    "avg_ns": 451661250,
    "stddev_ns": 1635843,
    "avg_ts": 283.400123,
    "stddev_ts": 1.024400,
    "samples_ns": [450000000, 453264706, 451719044],
    "samples_ts": [284.444444, 282.394737, 283.361189]
  }
]
"""

# stowlm-bench -v's stderr on a CUDA device (the kernel report among the other lines).
STOWLM_V = """smollm2-135m.gguf, tg128, n_ctx 128, n_ubatch 512, type_k f16:
  cuda:0   weights     92.10 MiB  kv     2.81 MiB  compute     0.33 MiB  copies     0.00 MiB  total     95.24 MiB
  tg128 on cuda:0: 725.0 kernels per token; 3.529 ms per token, of which 0.412 ms in kernels (run back to back) and 3.117 ms (88%) outside them (launch gaps, host work); host launches per token: 0.0 CUDA graphs and 725.0 kernels
  tg128: 96.6 MB of weights per token, read at 27.4 GB/s
peak RSS 411.20 MiB; largest expected: file 93.81 + kv 2.81 + compute 0.33 = 96.95 MiB (smollm2-135m.gguf, tg128); ratio 4.241
"""


def test_llama_bench_json_of_the_cuda_build():
    recs = gpu_compare.parse_results(LLAMA_JSON)
    assert [(r["test"], r["n_prompt"], r["n_gen"], r["backends"]) for r in recs] == [
        ("pp512", 512, 0, "CUDA"), ("tg128", 0, 128, "CUDA")]
    assert recs[0]["samples_ts"] == [49230.8, 48449.6, 49059.4]
    assert recs[1]["avg_ts"] == pytest.approx(statistics.mean([640.0, 632.2, 636.1]))
    assert recs[1]["raw"]["gpu_info"] == "NVIDIA H100 80GB HBM3"


def test_markdown_tables_of_both_tools():
    llama = gpu_compare.parse_results(LLAMA_MD)
    assert [(r["test"], r["samples_ts"], r["backends"]) for r in llama] == [
        ("pp512", [48911.11], "CUDA"), ("tg128", [636.12], "CUDA")]
    ours = gpu_compare.parse_results(STOWLM_MD)
    assert [(r["test"], r["n_prompt"], r["n_gen"], r["n_depth"], r["avg_ts"]) for r in ours] == [
        ("pp512", 512, 0, 0, 19560.21), ("tg128", 0, 128, 0, 283.40),
        ("pp512 @ d4096", 512, 0, 4096, 9120.50), ("tg128 @ d4096", 0, 128, 4096, 201.77)]


def test_stowlm_bench_json():
    (rec,) = gpu_compare.parse_results(STOWLM_JSON)
    assert (rec["test"], rec["backends"], rec["raw"]["devices"]) == ("tg128", "CUDA", "cuda:0")
    assert rec["samples_ts"] == [284.444444, 282.394737, 283.361189]


def test_test_names_and_bad_output():
    split = gpu_compare.split_test_name
    assert split("pp512") == (512, 0, 0) and split("tg128 @ d4096") == (0, 128, 4096)
    assert split("pp512+tg128") == (512, 128, 0)
    for bad in ("", "xx12", "pp", "tg12 @ 4096"):
        with pytest.raises(gpu_compare.ToolError):
            split(bad)
    with pytest.raises(gpu_compare.ToolError, match="no markdown table"):
        gpu_compare.parse_results("ggml_cuda_init: no CUDA devices found\nerror: failed to load model\n")
    with pytest.raises(gpu_compare.ToolError, match="columns"):
        gpu_compare.parse_results("| a | b |\n| - | - |\n| 1 | 2 |\n")


def test_kernel_report_lines():
    assert gpu_compare.parse_kernel_report(STOWLM_V) == [
        "tg128 on cuda:0: 725.0 kernels per token; 3.529 ms per token, of which 0.412 ms in kernels (run back to "
        "back) and 3.117 ms (88%) outside them (launch gaps, host work); host launches per token: 0.0 CUDA graphs "
        "and 725.0 kernels"]


def test_cublas_is_found_in_a_python_package(tmp_path, monkeypatch):
    """Not on the loader's path: a wheel's nvidia/<pkg>/lib folder is found and named."""
    monkeypatch.setattr(gpu_compare.subprocess, "run",
                        lambda *a, **k: types.SimpleNamespace(stdout="\tlibc.so.6 (libc6,x86-64) => /lib/libc.so.6\n"))
    monkeypatch.setattr(gpu_compare.site, "getsitepackages", lambda: [str(tmp_path)])
    monkeypatch.setattr(gpu_compare.site, "getusersitepackages", lambda: str(tmp_path / "none"))
    monkeypatch.setattr(gpu_compare.sys, "path", [])
    where, looked = gpu_compare.find_cublas()
    if where is not None and not where.startswith(str(tmp_path)):
        pytest.skip(f"this machine has cuBLAS in a CUDA toolkit ({where})")
    assert where is None and str(tmp_path) in looked
    lib = tmp_path / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcublas.so.13").write_bytes(b"")
    assert gpu_compare.find_cublas()[0] is None  # libcublasLt too, or llama.cpp's backend cannot load
    (lib / "libcublasLt.so.13").write_bytes(b"")
    assert gpu_compare.find_cublas()[0] == str(lib)


# ---- the whole script with stand-in tools --------------------------------------------------------

FAKE_TOOL = """#!{python}
# Prints llama-bench-style JSON for -p/-n; samples from a per-tool table and a call counter, so the
# test knows every figure. FAKE_BACKEND sets the backends field; STOWLM_CUDA_GRAPHS=0 counts apart.
import json, os, sys
a = sys.argv[1:]
p, n = int(a[a.index("-p") + 1]), int(a[a.index("-n") + 1])
log = os.environ["FAKE_LOG"]
label = {label!r} + (" no graphs" if os.environ.get("STOWLM_CUDA_GRAPHS") == "0" else "")
label += " unpinned" if os.environ.get("STOWLM_PIN_EXPERTS") == "0" else ""
with open(log, "a") as f:
    f.write(json.dumps(dict(tool=label, argv=a)) + "\\n")
k = sum(1 for line in open(log) if json.loads(line)["tool"] == label)
base = {base!r}
out = []
for test, n_prompt, n_gen in (("pp", p, 0), ("tg", 0, n)):
    if not (n_prompt or n_gen):
        continue
    s = [base[test] + 10 * k + j for j in range(3)]
    out.append(dict(backends=os.environ.get("FAKE_BACKEND", "CUDA"), n_prompt=n_prompt, n_gen=n_gen, n_depth=0,
                    avg_ts=sum(s) / 3, samples_ts=s, cpu_info="fake cpu"))
print("log line before the JSON")
print(json.dumps(out, indent=1))
"""


def fake_tool(tmp_path, label, base):
    path = tmp_path / f"fake-{label}"
    path.write_text(FAKE_TOOL.format(python=sys.executable, label=label, base=base))
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    models = tmp_path / "models"
    models.mkdir()
    for name in ("alpha", "beta"):
        (models / f"{name}.gguf").write_bytes(b"GGUF")
    monkeypatch.setenv("STOWLM_CACHE", str(tmp_path))
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "calls.jsonl"))
    monkeypatch.setattr(gpu_compare, "find_cublas", lambda: ("", "stubbed"))
    return dict(stowlm=fake_tool(tmp_path, "stowlm", {"pp": 1000, "tg": 100}),
                peer=fake_tool(tmp_path, "peer", {"pp": 2000, "tg": 50}), log=tmp_path / "calls.jsonl",
                out=tmp_path / "out")


def run_main(fakes, *extra):
    return gpu_compare.main(["--stowlm", fakes["stowlm"], "--peer", fakes["peer"], "-m", "alpha", "-m", "beta",
                             "-m", "gamma", "--rounds", "3", "-p", "64", "-n", "16", "--no-kernel-report",
                             "--out", str(fakes["out"]), *extra])


def test_alternation_medians_and_ratios(fakes, capsys):
    assert run_main(fakes) == 0
    printed = capsys.readouterr().out
    assert "model 'gamma' not found" in printed
    calls = [json.loads(line) for line in fakes["log"].read_text().splitlines()]
    # round by round, model by model: stowlm, stowlm with CUDA graphs off, then the peer
    assert [(c["tool"], c["argv"][c["argv"].index("-m") + 1].rsplit("/", 1)[-1]) for c in calls] == \
        [(t, f"{m}.gguf") for _ in range(3) for m in ("alpha", "beta") for t in ("stowlm", "stowlm no graphs", "peer")]
    for c in calls:
        a = c["argv"]
        assert a[a.index("-p") + 1] == "64" and a[a.index("-n") + 1] == "16" and a[a.index("-o") + 1] == "json"
        if c["tool"].startswith("stowlm"):
            assert a[a.index("-dev") + 1] == "cuda:0"
        else:
            assert a[a.index("-ngl") + 1] == "99" and a[a.index("-fa") + 1] == "1"
    # the k-th call of a tool gives base + 10k + (0, 1, 2): alpha has calls 1, 3, 5, beta 2, 4, 6
    data = json.loads((fakes["out"] / "gpu_compare.json").read_text())
    rows = {(r["model"], r["test"]): r for r in data["table"]}
    assert set(rows) == {(m, t) for m in ("alpha", "beta") for t in ("pp64", "tg16")}
    for model, ks in (("alpha", (1, 3, 5)), ("beta", (2, 4, 6))):
        for test, ours, theirs in (("pp64", 1000, 2000), ("tg16", 100, 50)):
            s = [ours + 10 * k + j for k in ks for j in range(3)]
            p = [theirs + 10 * k + j for k in ks for j in range(3)]
            r = rows[(model, test)]
            assert r["stowlm"] == statistics.median(s) and r["llama_cpp"] == statistics.median(p)
            assert r["ratio"] == pytest.approx(statistics.median(s) / statistics.median(p))
            assert r["stowlm_no_graphs"] == statistics.median(s)  # its own call counter, the same figures
            assert sorted(r["stowlm_samples"]) == sorted(s)
    md = (fakes["out"] / "gpu_compare.md").read_text()
    alpha_tg = rows[("alpha", "tg16")]
    assert (f"| alpha | tg16 | {alpha_tg['stowlm']:.2f} | {alpha_tg['llama_cpp']:.2f} | "
            f"{alpha_tg['ratio']:.2f} | {alpha_tg['stowlm_no_graphs']:.2f} |") in md
    assert data["errors"] == [] and data["peer_unavailable"] is None


def test_a_peer_that_fell_back_to_the_cpu_is_refused(fakes, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_BACKEND", "CPU")  # llama.cpp without its CUDA backend runs on the CPU
    assert run_main(fakes) == 1
    data = json.loads((fakes["out"] / "gpu_compare.json").read_text())
    assert any("not CUDA" in e for e in data["errors"])
    peer_calls = [c for c in map(json.loads, fakes["log"].read_text().splitlines()) if c["tool"] == "peer"]
    assert len(peer_calls) == 1  # not asked again
    assert all(r["llama_cpp"] is None and r["stowlm"] for r in data["table"])


def test_without_cublas_the_peer_is_unavailable(fakes, monkeypatch, capsys):
    monkeypatch.setattr(gpu_compare, "find_cublas", lambda: (None, "ldconfig -p, /nowhere"))
    assert run_main(fakes) == 0
    out = capsys.readouterr().out
    assert "cuBLAS (libcublas.so.13, libcublasLt.so.13) not found (ldconfig -p, /nowhere)" in out
    data = json.loads((fakes["out"] / "gpu_compare.json").read_text())
    assert "cuBLAS" in data["peer_unavailable"]
    assert all(c["tool"].startswith("stowlm") for c in map(json.loads, fakes["log"].read_text().splitlines()))


def test_bad_arguments(fakes, capsys):
    with pytest.raises(SystemExit):
        run_main(fakes, "-r", "0")
    with pytest.raises(SystemExit):
        run_main(fakes, "--device", "tpu")
    assert gpu_compare.main(["--stowlm", fakes["stowlm"], "--no-peer", "-m", "/no/such.gguf",
                             "--out", str(fakes["out"])]) == 2
    assert "no model to run" in capsys.readouterr().err


# ---- real runs on the CPU ------------------------------------------------------------------------

def test_stowlm_side_on_the_cpu(tmp_path):
    """The real stowlm-bench through the script (--device cpu), tiny tests: a row per test."""
    from test_bench import bench_exe

    get_model("smollm2-135m")
    r = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_compare.py"), "--device", "cpu", "--no-peer",
                        "--stowlm", bench_exe(), "-m", "smollm2-135m", "-p", "8", "-n", "2", "-r", "1",
                        "--rounds", "1", "-t", "1", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "gpu_compare.json").read_text())
    assert [(row["model"], row["test"]) for row in data["table"]] == [("smollm2-135m", "pp8"),
                                                                       ("smollm2-135m", "tg2")]
    assert all(row["stowlm"] > 0 and row["llama_cpp"] is None for row in data["table"])
    assert data["backends"] == {"stowlm": "CPU"} and "--no-peer" in data["peer_unavailable"]
    assert [c["command"][c["command"].index("-dev") + 1] for c in data["calls"]] == ["cpu", "cpu"]


def test_prebuilt_peer_on_the_cpu(tmp_path):
    """llama.cpp's CUDA build from ../shared/peers runs on the CPU (-ngl 0 -dev none) when its CUDA
    backend cannot load: the script unpacks it and reads its JSON beside stowlm-bench's."""
    from test_bench import bench_exe

    tar = gpu_compare.default_peer_tar()
    if tar is None:
        pytest.skip(f"no {gpu_compare.PEER_TAR} in .carry/ or ../shared/peers")
    get_model("smollm2-135m")
    r = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_compare.py"), "--device", "cpu",
                        "--stowlm", bench_exe(), "--peer-tar", str(tar), "-m", "smollm2-135m", "-p", "8", "-n", "0",
                        "-r", "1", "--rounds", "1", "-t", "1", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, OUT=""))
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "gpu_compare.json").read_text())
    (row,) = data["table"]
    assert row["test"] == "pp8" and row["stowlm"] > 0 and row["llama_cpp"] > 0
    assert row["ratio"] == pytest.approx(row["stowlm"] / row["llama_cpp"])
    peer = [c for c in data["calls"] if c["tool"] == "llama.cpp"][0]["command"]
    assert peer[0].endswith("llcuda-peer/llama-bench.sh") and peer[peer.index("-dev") + 1] == "none"


def test_placement_arguments_and_variants(fakes):
    """--stowlm-args / --peer-args replace each tool's placement (the big MoE: a fit's devices and
    -ot for both); each --variant is one more stowlm row per round with its arguments added, in a
    column of its own."""
    assert gpu_compare.main(["--stowlm", fakes["stowlm"], "--peer", fakes["peer"], "-m", "alpha", "--rounds", "2",
                             "-p", "64", "-n", "16", "--no-kernel-report", "--no-graphs-off", "--out", str(fakes["out"]),
                             # (=: the values start with a dash)
                             "--stowlm-args=-dev 'cuda:0[mem=8GiB],cpu' -ot exps=cpu:0",
                             "--peer-args=-ngl 99 -ot exps=CPU",
                             "--variant", "experts on the CPU=--moe-offload-min 0",
                             "--variant", "unpinned=STOWLM_PIN_EXPERTS=0 --moe-offload-min 64"]) == 0
    calls = [json.loads(line) for line in fakes["log"].read_text().splitlines()]
    ours = [c["argv"] for c in calls if c["tool"] == "stowlm"]
    assert len(ours) == 4  # the plain row and the first variant, two rounds
    # the second variant: its environment setting reaches the tool, its arguments follow
    unpinned = [c["argv"] for c in calls if c["tool"] == "stowlm unpinned"]
    assert len(unpinned) == 2 and all(a[a.index("--moe-offload-min") + 1] == "64" for a in unpinned)
    assert not any("STOWLM_PIN_EXPERTS=0" in a for a in unpinned)
    for a in ours:
        assert a[a.index("-dev") + 1] == "cuda:0[mem=8GiB],cpu" and a[a.index("-ot") + 1] == "exps=cpu:0"
    assert sum("--moe-offload-min" in a for a in ours) == 2
    peer = [c["argv"] for c in calls if c["tool"] == "peer"]
    assert len(peer) == 2 and all(a[a.index("-ot") + 1] == "exps=CPU" and "-fa" not in a for a in peer)
    md = (fakes["out"] / "gpu_compare.md").read_text()
    assert "| stowlm, experts on the CPU |" in md
    data = json.loads((fakes["out"] / "gpu_compare.json").read_text())
    assert all(set(r["variants"]) == {"experts on the CPU", "unpinned"} for r in data["table"])
    with pytest.raises(SystemExit):
        gpu_compare.main(["--stowlm", fakes["stowlm"], "--no-peer", "-m", "alpha", "--variant", "no label"])


def test_big_moe_arguments_follow_the_fit(model_path):
    """bench/big_moe_compare.py gives stowlm-bench a fitted placement's devices, layers and
    overrides (each device then holds the weights fit projected for it) and llama-bench the GPU's
    layer count and the overrides to the CPU in one -ot; here on two CPU devices, the smaller spilling
    experts to the host."""
    import big_moe_compare
    from stowlm.fit import fit
    from test_bench import bench

    path = str(model_path("smollm2-moe"))
    pl = fit(path, "cpu:1[mem=64MiB],cpu:0", n_ctx=4096)
    ours, theirs = big_moe_compare.tool_args(pl)
    assert any(d.expert_layers and not d.n_layers for d in pl.devices) or \
        any(set(d.expert_layers) - {l for r in d.layers for l in range(r[0], r[1] + 1)} for d in pl.devices)
    r = bench("-m", path, *ours, "-p", 8, "-n", 0, "-r", 1, "-v", "--no-warmup")
    rows = {ln.split()[0]: dict(zip(ln.split()[1::3], map(float, ln.split()[2::3])))
            for ln in r.stderr.splitlines() if ln.strip().startswith("cpu:")}
    for d in pl.used_devices:
        assert rows[d.name]["weights"] == pytest.approx(d.projected["weights"] / 2**20, abs=0.006), d.name
    assert theirs[:2] == ["-ngl", "0"]  # no GPU device here
    # one -ot: llama-bench runs each -ot given as a test of its own (the overrides joined by ';')
    ots = [theirs[i + 1] for i, x in enumerate(theirs) if x == "-ot"]
    assert len(ots) == 1
    parts = ots[0].split(";")
    assert all(o.endswith("=CPU") for o in parts)
    assert parts == [o.rpartition("=")[0] + "=CPU" for o in pl.tensor_overrides if o.rpartition("=")[2].startswith("cpu")]


def test_big_moe_sweep_times_each_micro_batch_and_each_op(model_path, capsys):
    """big_moe_compare's sweep (what moe_offload_min's default rests on): prompt speed for each
    micro-batch size with the staged products on (--moe-offload-min 1) and off (0), one row each,
    the ratio the two speeds' own; then a -v run with each device's op table. Here on two CPU
    devices (no staging: both columns run the CPU's experts)."""
    import big_moe_compare
    from stowlm.fit import fit
    from test_bench import bench_exe

    path = model_path("smollm2-moe")
    pl = fit(str(path), "cpu:1[mem=64MiB],cpu:0", n_ctx=512)
    ours, _ = big_moe_compare.tool_args(pl)
    big_moe_compare.sweep(bench_exe(), path, ours + ["-t", "1"])
    out = capsys.readouterr().out
    rows = [ln.split("|")[1:-1] for ln in out.splitlines() if re.match(r"^\| pp\d+ \|", ln)]
    assert [r[0].strip() for r in rows] == [f"pp{n}" for n in (16, 32, 64, 128, 256, 512)], out
    for _, gpu, cpu, ratio in rows:
        assert float(gpu) > 0 and float(cpu) > 0
        assert float(ratio) == pytest.approx(float(gpu) / float(cpu), abs=0.006)
    assert "--moe-offload-min 1" in out and "--moe-offload-min 0" in out
    # the -v run: each device's ops, the experts' products among cpu:0's
    assert re.search(r"tg32 on cpu:0: [\d.]+ ms per token", out) and "ffn_gate_exps.weight" in out, out
