"""What a GPU session carries and runs, checked without a GPU: bench/carry_models.py cuts a model
into pieces and joins them again (sha256 of every piece and of the whole against hashlib on the
original), refuses a damaged piece, leaves an incomplete model out, plans device calls within the
carry limit, and tells whether a carried build fits; bench/gpu_session.sh --no-gpu runs every step
that needs no GPU and leaves in $OUT what a device call can bring back."""
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, get_model, subprocess_env

sys.path.insert(0, str(REPO / "bench"))
import carry_models  # noqa: E402

MIB = 1 << 20


def carry(*args, env=None):
    return subprocess.run([sys.executable, str(REPO / "bench" / "carry_models.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=300, env=env)


def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def model():
    return get_model("qwen3moe-tiny")  # 36 MB: pieces of 8 MiB make five


def test_split_receive_assemble(model, tmp_path):
    c, stash, models = tmp_path / "carry", tmp_path / "stash", tmp_path / "models"
    r = carry(model, "--dir", c, "--piece-mib", 8)
    assert r.returncode == 0, r.stderr
    m = json.loads((c / "manifest.json").read_text())
    e = m["models"][model.name]
    size = model.stat().st_size
    assert e["sha256"] == sha256(model) and e["bytes"] == size
    assert [p["name"] for p in e["pieces"]] == [f"{model.name}.part{i:02d}" for i in range(-(-size // (8 * MIB)))]
    for p in e["pieces"]:
        assert p["bytes"] <= 8 * MIB and p["sha256"] == sha256(c / p["name"])
    assert b"".join((c / p["name"]).read_bytes() for p in e["pieces"]) == model.read_bytes()

    # the calls arrive one by one: after the first piece alone the model is incomplete
    first = c / e["pieces"][0]["name"]
    held = tmp_path / "held"
    held.mkdir()
    for p in e["pieces"][1:]:
        (c / p["name"]).rename(held / p["name"])
    assert carry("--dir", c, "--stash", stash, "--receive").returncode == 0
    assert not first.exists() and (stash / first.name).exists()  # moved out of the carried folder
    r = carry("--dir", c, "--stash", stash, "--assemble", "--to", models)
    assert r.returncode == 0 and f"incomplete: {len(e['pieces']) - 1} of {len(e['pieces'])} pieces missing" in r.stdout
    assert not (models / model.name).exists()
    for p in e["pieces"][1:]:
        (held / p["name"]).rename(c / p["name"])
    r = carry("--dir", c, "--stash", stash, "--receive")
    assert r.returncode == 0 and "received into" in r.stdout
    r = carry("--dir", c, "--stash", stash, "--assemble", "--to", models)
    assert r.returncode == 0 and "assembled" in r.stdout and "sha256 ok" in r.stdout
    assert sha256(models / model.name) == sha256(model)
    assert "already there" in carry("--dir", c, "--stash", stash, "--assemble", "--to", models).stdout


def test_a_damaged_piece_is_refused(model, tmp_path):
    c, stash = tmp_path / "carry", tmp_path / "stash"
    assert carry(model, "--dir", c, "--piece-mib", 16).returncode == 0
    piece = c / f"{model.name}.part01"
    data = bytearray(piece.read_bytes())
    data[12345] ^= 1
    piece.write_bytes(bytes(data))
    r = carry("--dir", c, "--stash", stash, "--receive")
    assert r.returncode == 1 and f"{piece}: sha256" in r.stderr and "the manifest says" in r.stderr


def test_bad_requests_are_clear(tmp_path):
    r = carry("--dir", tmp_path)
    assert r.returncode == 2 and "nothing to do" in r.stderr
    r = carry(tmp_path / "missing.gguf", "--dir", tmp_path)
    assert r.returncode == 1 and "missing.gguf does not exist" in r.stderr
    r = carry("--dir", tmp_path / "none", "--stash", tmp_path / "stash", "--receive")
    assert r.returncode == 1 and "carry .carry/manifest.json with every call" in r.stderr
    r = carry("--dir", tmp_path / "none", "--stash", tmp_path / "empty", "--assemble")
    assert r.returncode == 1 and "run --receive first" in r.stderr
    big = tmp_path / "x.gguf"
    big.write_bytes(b"GGUF")
    r = carry(big, "--dir", tmp_path, "--piece-mib", 61)
    assert r.returncode == 1 and "a piece must be 1..60 MiB" in r.stderr


def test_plan_fits_every_call():
    """Every piece and extra in exactly one call, each call within the budget and 8 paths, the
    manifest in each."""
    budget = 61 * MIB
    m = {"extras": {"llama.cpp-cuda-sm90.tar.xz": {"bytes": 44761980}, "prebuilt": {"bytes": 11932752},
                    "shared/tools": {"bytes": 40000}, "shared/fixtures": {"bytes": 480000}, "wheels": {"bytes": 118475}},
         "models": {"a.gguf": {"pieces": [{"name": "a.gguf.part00", "bytes": 60 * MIB},
                                          {"name": "a.gguf.part01", "bytes": 35 * MIB}]},
                    "b.gguf": {"pieces": [{"name": "b.gguf.part00", "bytes": 5 * MIB}]}}}
    size = {f".carry/{k}": v["bytes"] for k, v in m["extras"].items()}
    size[".carry/shared"] = 520000
    size.update({f".carry/{p['name']}": p["bytes"] for e in m["models"].values() for p in e["pieces"]})
    calls = carry_models.plan_calls(m, budget)
    listed = [p for c in calls for p in c if p != ".carry/manifest.json"]
    wanted = {".carry/llama.cpp-cuda-sm90.tar.xz", ".carry/prebuilt", ".carry/shared", ".carry/wheels",
              ".carry/a.gguf.part00", ".carry/a.gguf.part01", ".carry/b.gguf.part00"}
    assert sorted(listed) == sorted(wanted)
    for c in calls:
        assert c[0] == ".carry/manifest.json" and len(c) <= 8
        assert sum(size[p] for p in c[1:]) <= budget
    assert len(calls) == 3  # 156 MiB in all needs three calls of 61 MiB
    with pytest.raises(carry_models.CarryError, match="more than one call"):
        carry_models.plan_calls({"extras": {"huge": {"bytes": 70 * MIB}}, "models": {}}, budget)


def test_prebuilt_check(tmp_path, monkeypatch):
    stash = tmp_path / "stash"
    (stash / "prebuilt").mkdir(parents=True)
    tag = carry_models.python_tag()
    ext = f"_core.{tag}-x86_64-linux-gnu.so"
    for f in ("stowlm-bench", ext):
        (stash / "prebuilt" / f).write_bytes(b"\x7fELF")
    entry = {"bytes": 8, "python_tag": tag, "extension": ext, "cuda_archs": "90",
             "source_digest": carry_models.source_digest()}
    carry_models.save_manifest(stash, {"models": {}, "extras": {"prebuilt": entry}})
    assert carry_models.check_prebuilt(stash) == ""
    carry_models.save_manifest(stash, {"models": {}, "extras": {"prebuilt": dict(entry, source_digest="0" * 64)}})
    assert "other sources" in carry_models.check_prebuilt(stash)
    carry_models.save_manifest(stash, {"models": {}, "extras": {"prebuilt": dict(entry, python_tag="cpython-399")}})
    assert "for cpython-399" in carry_models.check_prebuilt(stash)
    carry_models.save_manifest(stash, {"models": {}, "extras": {}})
    assert carry_models.check_prebuilt(stash) == "no prebuilt build was carried"


def test_source_digest_follows_the_sources(tmp_path):
    for d in carry_models.SOURCE_DIRS:
        (tmp_path / d).mkdir()
        (tmp_path / d / "a.h").write_text("int a;")
    for f in carry_models.SOURCE_FILES:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("x")
    before = carry_models.source_digest(tmp_path)
    (tmp_path / "cuda" / "a.h").write_text("int b;")
    assert carry_models.source_digest(tmp_path) != before
    (tmp_path / "cuda" / "a.h").write_text("int a;")
    assert carry_models.source_digest(tmp_path) == before


def test_session_script_without_a_gpu(model, tmp_path):
    """gpu_session.sh --no-gpu: each step in order, the GPU tests collected with the absent models'
    cases deselected, the comparison on the CPU (a model too big to carry by its shape twin: here
    one made from the small model under qwen2.5-coder-0.5b's name), and $OUT as a device call can
    bring it back (at most 8 files, two folders deep, plain names)."""
    import shape_twin

    c, out = tmp_path / "carry", tmp_path / "out"
    assert carry(model, "--dir", c, "--piece-mib", 16).returncode == 0
    (tmp_path / "stash" / "twins").mkdir(parents=True)
    shape_twin.save(model, tmp_path / "stash" / "twins" / "qwen2.5-coder-0.5b.twin")
    # the same stowlm as this run (installed in CI, python/ in a development build)
    env = subprocess_env(CARRY_DIR=str(c), STOWLM_CARRIED=str(tmp_path / "stash"), OUT=str(out),
                         STOWLM_CACHE=str(tmp_path / "cache"), SESSION_SECONDS="300", PYTHON=sys.executable)
    r = subprocess.run(["bash", str(REPO / "bench" / "gpu_session.sh"), "--no-gpu"], capture_output=True, text=True,
                       timeout=280, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    log = (out / "session.log").read_text()
    order = ["--- nvidia-smi", "amx_int8: ", "== receive", "== assemble", "--- cuBLAS", "== prebuilt check",
             "== import", "GPU tests: ", "== GPU tests (collected only)", "== gpu_compare (cpu)", "summary:"]
    at = [log.find(s) for s in order]
    assert all(i >= 0 for i in at) and at == sorted(at), list(zip(order, at))
    assert f"{tmp_path / 'cache' / 'models' / model.name}: assembled" in log
    assert "no smollm2-135m: test_cuda_models.py left out" in log
    # every model the session cannot have is deselected, qwen3moe-tiny (carried) is not
    k = re.search(r'-k "([^"]*)"', log).group(1)
    assert set(k.split(" and ")) == {"not gemma3", "not qwen2.5", "not gptoss", "not deepseek2", "not glm4moe"}
    collected = (out / "pytest_gpu.log").read_text()
    assert "tests/test_cuda_ops.py::" in collected and "tests/test_cuda_build.py::" in collected
    data = json.loads((out / "gpu_compare.json").read_text())
    assert data["device"] == "cpu"
    assert {(row["model"], row["test"]) for row in data["table"]} == {
        (m, t) for m in ("qwen3moe-tiny", "qwen2.5-coder-0.5b-twin") for t in ("pp16", "tg4")}
    assert "== twin qwen2.5-coder-0.5b" in log
    assert all(row["stowlm"] > 0 for row in data["table"])
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 1 <= len(files) <= 8
    for p in files:
        rel = p.relative_to(out)
        assert len(rel.parts) <= 3 and all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for part in rel.parts), rel
        assert p.stat().st_size <= 16 * MIB
    assert sorted(p.name for p in files) == ["gpu_compare.json", "gpu_compare.md", "pytest_gpu.log", "session.log"]
