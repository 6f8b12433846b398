#!/usr/bin/env python3
"""What a GPU session carries to the device machine, in parts that fit its calls (each call takes at
most 64 MiB of git-ignored files beside the ~2 MiB tree), and their reassembly there.

Here, on the machine without a GPU (everything lands in .carry/, which git ignores):

    python3 bench/carry_models.py smollm2-135m [qwen3moe-tiny ...]   # models cut into pieces <= 60 MiB
    python3 bench/carry_models.py --extras --prebuilt build-py312    # peer, shared tools and fixtures,
                                                                      # the gguf wheel, a prebuilt build,
                                                                      # shape twins of the models too big
                                                                      # to carry (bench/shape_twin.py)
    python3 bench/carry_models.py --plan                              # the device calls, with their carry lists

A model is a name of the stowlm cache (~/.cache/stowlm/models/NAME.gguf) or a path. manifest.json
holds the sha256 of every piece and of every whole file, and a digest of the sources a prebuilt
build was made from. On the device (bench/gpu_session.sh runs these itself):

    python3 bench/carry_models.py --receive     # every call: the pieces and extras of .carry/, each
                                                # checked, into the stash (~/.cache/stowlm/carried)
    python3 bench/carry_models.py --assemble    # each model whose pieces are all there, joined into
                                                # ~/.cache/stowlm/models (--to DIR), sha256 checked
    python3 bench/carry_models.py --check-prebuilt   # is the carried build this tree's, for this Python?

The stash is outside the repository because a call replaces what its carry list names and nothing
promises that other ignored files survive between calls; the machine itself stays while it is warm.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
CARRY = REPO / ".carry"
MIB = 1 << 20
CALL_MIB = 64           # a device call's limit on the working tree plus the carried files
PIECE_MIB = 60          # leaves room for the tree (~2 MiB) and the manifest
PEER_TAR = "llama.cpp-cuda-sm90.tar.xz"
# The sources a prebuilt extension and stowlm-bench are compiled from.
SOURCE_DIRS = ("csrc", "cuda")
SOURCE_FILES = ("CMakeLists.txt", "bench/stowlm_bench.cpp")


class CarryError(RuntimeError):
    pass


def _load_pull():
    """python/stowlm/pull.py on its own (standard library only): the model cache's layout and the
    sha256 reader, without the package, whose extension is not installed yet when files arrive."""
    spec = importlib.util.spec_from_file_location("stowlm_pull", REPO / "python" / "stowlm" / "pull.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up while it loads
    spec.loader.exec_module(mod)
    return mod


pull = _load_pull()


def cache_models() -> Path:
    return pull.default_cache_dir() / "models"


def default_stash() -> Path:
    return Path(os.environ.get("STOWLM_CARRIED", pull.default_cache_dir() / "carried"))


def sha256_file(path: Path) -> str:
    return pull._sha256_file(path)


def source_digest(root: Path = REPO) -> str:
    """sha256 over the sources of the native build (paths and bytes, sorted), the same here and on
    the device, where the tree arrives without .git."""
    files = [root / f for f in SOURCE_FILES]
    for d in SOURCE_DIRS:
        files += [p for p in (root / d).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    h = hashlib.sha256()
    for p in sorted(files):
        h.update(str(p.relative_to(root)).encode() + b"\0")
        h.update(p.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def load_manifest(carry: Path) -> dict:
    path = carry / "manifest.json"
    if not path.exists():
        return {"models": {}, "extras": {}}
    m = json.loads(path.read_text())
    m.setdefault("models", {})
    m.setdefault("extras", {})
    return m


def save_manifest(carry: Path, m: dict) -> None:
    carry.mkdir(parents=True, exist_ok=True)
    tmp = carry / "manifest.json.tmp"
    tmp.write_text(json.dumps(m, indent=1, sort_keys=True) + "\n")
    tmp.replace(carry / "manifest.json")


def resolve_model(spec: str) -> Path:
    """A path, or a name of the stowlm cache (smollm2-135m -> MODELS/smollm2-135m.gguf)."""
    p = Path(spec).expanduser()
    if p.suffix == ".gguf" or os.sep in spec:
        return p
    return pull.model_path(spec)


def tree_bytes() -> int:
    """What a device call sends besides the carried paths: tracked and untracked-not-ignored files."""
    try:
        names = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "-co", "--exclude-standard"],
                               capture_output=True, check=True, timeout=60).stdout.split(b"\0")
    except (OSError, subprocess.SubprocessError):
        return 0
    total = 0
    for n in names:
        p = REPO / os.fsdecode(n)
        if n and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


# ---- here: cutting models and gathering the extras ---------------------------------------------

def split_model(path: Path, carry: Path, piece_bytes: int) -> dict:
    """Cuts path into carry/NAME.partNN pieces; returns its manifest entry."""
    if not path.is_file():
        raise CarryError(f"model {path} does not exist")
    if piece_bytes < MIB or piece_bytes > PIECE_MIB * MIB:
        raise CarryError(f"a piece must be 1..{PIECE_MIB} MiB, not {piece_bytes / MIB:g} MiB")
    carry.mkdir(parents=True, exist_ok=True)
    name = path.name
    for old in carry.glob(f"{glob_escape(name)}.part*"):
        old.unlink()
    whole = hashlib.sha256()
    pieces = []
    with open(path, "rb") as f:
        for data in iter(lambda: f.read(piece_bytes), b""):
            whole.update(data)
            piece = f"{name}.part{len(pieces):02d}"
            (carry / piece).write_bytes(data)
            pieces.append({"name": piece, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    size = sum(p["bytes"] for p in pieces)
    return {"bytes": size, "sha256": whole.hexdigest(), "pieces": pieces}


def glob_escape(s: str) -> str:
    return re.sub(r"([*?\[\]])", r"[\1]", s)


def copy_into(src: Path, dst: Path) -> int:
    """Copies a file or a folder (no __pycache__); returns the bytes."""
    if src.is_dir():
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        return sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    shutil.copymode(src, dst)
    dst.chmod(dst.stat().st_mode | 0o200)  # ../shared is read-only: a later --extras must overwrite the copy
    return dst.stat().st_size


def shared_dir() -> Path:
    return Path(os.environ["STOWLM_SHARED"]) if "STOWLM_SHARED" in os.environ else REPO.parent / "shared"


# Models too big to carry whose speed the GPU session measures on their shape twins (their
# headers, weights made random there: bench/shape_twin.py).
TWIN_MODELS = ("qwen2.5-coder-0.5b", "gemma3-270m")


def gather_extras(carry: Path, prebuilt: Optional[Path], python_tag: str) -> dict:
    """The peer tarball, ../shared's tools (the MoE and architecture test models are written from
    smollm2 by them) and fixtures (llama.cpp's logits the GPU tests compare with), the gguf wheel
    (the tests' oracles and the tools need it; the device image has none), the shape twins of
    TWIN_MODELS found in the model cache, and optionally a prebuilt extension for python_tag and
    stowlm-bench."""
    extras = {}
    twins = carry / "twins"
    if twins.exists():
        shutil.rmtree(twins)
    twins.mkdir(parents=True)
    sys.path.insert(0, str(REPO / "bench"))
    import shape_twin

    for name in TWIN_MODELS:
        model = cache_models() / f"{name}.gguf"
        if model.is_file():
            shape_twin.save(model, twins / f"{name}.twin")
            extras[f"twins/{name}.twin"] = {"bytes": (twins / f"{name}.twin").stat().st_size}
    shared = shared_dir()
    peer = shared / "peers" / PEER_TAR
    if not peer.is_file():
        raise CarryError(f"no {peer} (set STOWLM_SHARED)")
    extras[PEER_TAR] = {"bytes": copy_into(peer, carry / PEER_TAR)}
    for sub in ("tools", "fixtures"):
        if not (shared / sub).is_dir():
            raise CarryError(f"no {shared / sub}")
        extras[f"shared/{sub}"] = {"bytes": copy_into(shared / sub, carry / "shared" / sub)}
    wheels = carry / "wheels"
    if wheels.exists():
        shutil.rmtree(wheels)
    wheels.mkdir(parents=True)
    try:
        import gguf  # noqa: F401  (its version is the one the tools' sha256 were made with)
        from importlib.metadata import version

        want = f"gguf=={version('gguf')}"
    except Exception:  # noqa: BLE001
        want = "gguf"
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", want,
                        "-d", str(wheels)], capture_output=True, text=True)
    if r.returncode != 0:
        raise CarryError(f"pip download {want} failed:\n{r.stderr[-2000:]}")
    extras["wheels"] = {"bytes": sum(p.stat().st_size for p in wheels.iterdir()), "what": want}
    if prebuilt is not None:
        extras["prebuilt"] = gather_prebuilt(carry, prebuilt, python_tag)
    return extras


def gather_prebuilt(carry: Path, build: Path, python_tag: str) -> dict:
    """stowlm-bench of a CUDA build and the extension for python_tag (cpython-312: the device's
    Python) from python/stowlm, with the build's CUDA architectures and the sources' digest."""
    cache = build / "CMakeCache.txt"
    if not cache.is_file():
        raise CarryError(f"{build} is not a CMake build folder")
    text = cache.read_text(errors="replace")
    archs = re.search(r"^CMAKE_CUDA_ARCHITECTURES:\w+=(.*)$", text, re.M)
    if "STOWLM_CUDA:BOOL=ON" not in text or not archs:
        raise CarryError(f"{build} was not configured with the CUDA backend")
    bench = build / "stowlm-bench"
    ext = sorted((REPO / "python" / "stowlm").glob(f"_core.{python_tag}-*.so"))
    if not bench.is_file() or not ext:
        raise CarryError(f"build {build} first: it needs stowlm-bench and python/stowlm/_core.{python_tag}-*.so "
                         f"(cmake -S . -B {build.name} -G Ninja -DCMAKE_CUDA_ARCHITECTURES=90 "
                         f"-DPython_EXECUTABLE=<python of that version> && cmake --build {build.name} "
                         "--target _core stowlm-bench)")
    sources = [p for d in SOURCE_DIRS for p in (REPO / d).rglob("*") if p.is_file()] + [REPO / f for f in SOURCE_FILES]
    newest_source = max(p.stat().st_mtime for p in sources)
    if min(bench.stat().st_mtime, ext[0].stat().st_mtime) < newest_source:
        raise CarryError(f"{bench} or {ext[0].name} is older than the sources: rebuild {build}")
    dst = carry / "prebuilt"
    if dst.exists():
        shutil.rmtree(dst)
    size = copy_into(bench, dst / "stowlm-bench") + copy_into(ext[0], dst / ext[0].name)
    return {"bytes": size, "cuda_archs": archs.group(1), "python_tag": python_tag, "extension": ext[0].name,
            "source_digest": source_digest()}


# ---- here: the device calls --------------------------------------------------------------------

def folder_extras(m: dict) -> Dict[str, int]:
    """Extras inside a folder (shared/tools, twins/NAME.twin): one carry item per folder, since a
    receive replaces the whole folder in the stash."""
    out: Dict[str, int] = {}
    for name, e in m["extras"].items():
        if "/" in name:
            top = f".carry/{name.split('/')[0]}"
            out[top] = out.get(top, 0) + e["bytes"]
    return out


def plan_calls(m: dict, budget: int) -> List[List[str]]:
    """The carry lists of the device calls: extras first, then pieces in order; each list holds
    manifest.json and at most 8 paths, and stays within the budget."""
    items = [(f".carry/{name}", e["bytes"]) for name, e in sorted(m["extras"].items()) if "/" not in name]
    items += sorted(folder_extras(m).items())
    items.sort(key=lambda it: -it[1])  # the big extras first, then the small ones fill in
    for name in m["models"]:
        items += [(f".carry/{p['name']}", p["bytes"]) for p in m["models"][name]["pieces"]]
    calls: List[List[str]] = []
    sizes: List[int] = []
    for path, size in items:
        if size > budget:
            raise CarryError(f"{path} is {size / MIB:.1f} MiB, more than one call's {budget / MIB:.1f} MiB")
        for i, c in enumerate(calls):  # first fit keeps the pieces of a model in order
            if sizes[i] + size <= budget and len(c) < 8:
                c.append(path)
                sizes[i] += size
                break
        else:
            calls.append([".carry/manifest.json", path])
            sizes.append(size)
    return calls


def print_plan(m: dict, carry: Path) -> None:
    tree = tree_bytes()
    # 1 MiB to spare: 61.2 MiB beside a 2.7 MiB tree was refused as over 64 MiB, 60.0 went (2026-11-28)
    budget = CALL_MIB * MIB - tree - (carry / "manifest.json").stat().st_size - MIB
    calls = plan_calls(m, budget)
    print(f"tree {tree / MIB:.2f} MiB; each call carries at most {budget / MIB:.2f} MiB beside it")
    for name, e in sorted(m["models"].items()):
        print(f"model {name}: {e['bytes'] / MIB:.1f} MiB in {len(e['pieces'])} piece(s)")
    for name, e in sorted(m["extras"].items()):
        print(f"extra {name}: {e['bytes'] / MIB:.1f} MiB")
    sizes = {f".carry/{n}": e["bytes"] for n, e in m["extras"].items()}
    sizes.update(folder_extras(m))
    for e in m["models"].values():
        sizes.update({f".carry/{p['name']}": p["bytes"] for p in e["pieces"]})
    print(f"\n{len(calls)} device call(s), one right after the other (a machine idle for 30 s is given back; "
          "from the second on each reply must say warm: true, else start again at the first):")
    for i, c in enumerate(calls, 1):
        last = i == len(calls)
        cmd = ("bash bench/gpu_session.sh" if last else "python3 bench/carry_models.py --receive")
        mib = sum(sizes.get(p, 0) for p in c) / MIB
        print(f"  {i}. carry={json.dumps(c)}  ({mib:.1f} MiB)\n     command: {cmd}"
              + ("  timeout_s=560" if last else "  timeout_s=120"))


# ---- on the device ----------------------------------------------------------------------------

def receive(carry: Path, stash: Path, keep: bool = False) -> List[str]:
    """Moves (keep: copies) the checked pieces and the extras of carry into the stash; returns
    what moved."""
    put = (lambda src, dst: copy_into(src, dst)) if keep else (lambda src, dst: shutil.move(str(src), str(dst)))
    m = load_manifest(carry)
    if not (carry / "manifest.json").exists():
        raise CarryError(f"no {carry / 'manifest.json'}: carry .carry/manifest.json with every call")
    stash.mkdir(parents=True, exist_ok=True)
    merged = load_manifest(stash)
    merged["models"].update(m["models"])
    merged["extras"].update(m["extras"])
    save_manifest(stash, merged)
    moved = []
    for e in m["models"].values():
        for p in e["pieces"]:
            src = carry / p["name"]
            if not src.exists():
                continue
            got = sha256_file(src)
            if got != p["sha256"]:
                raise CarryError(f"{src}: sha256 {got}, the manifest says {p['sha256']}")
            put(src, stash / p["name"])
            moved.append(p["name"])
    for name in m["extras"]:
        top = name.split("/")[0]
        src = carry / top
        if src.exists():
            dst = stash / top
            if dst.is_dir():
                shutil.rmtree(dst)
            elif dst.exists():
                dst.unlink()
            put(src, dst)
            moved.append(top)
    return sorted(set(moved))


def assemble(stash: Path, to: Path, carry: Optional[Path] = None) -> Dict[str, str]:
    """Joins each model whose pieces are all in the stash (or carry) into `to`, checking every
    piece and the whole; returns {file: what happened}."""
    m = load_manifest(stash)
    if carry is not None:
        m["models"].update(load_manifest(carry)["models"])
    if not m["models"]:
        raise CarryError(f"no models in {stash / 'manifest.json'}: run --receive first")
    to.mkdir(parents=True, exist_ok=True)
    status = {}
    for name, e in sorted(m["models"].items()):
        dst = to / name
        if dst.is_file() and dst.stat().st_size == e["bytes"] and sha256_file(dst) == e["sha256"]:
            status[name] = "already there"
            continue
        srcs, missing = [], []
        for p in e["pieces"]:
            where = [d / p["name"] for d in ([stash] + ([carry] if carry else [])) if (d / p["name"]).is_file()]
            (srcs.append(where[0]) if where else missing.append(p["name"]))
        if missing:
            status[name] = f"incomplete: {len(missing)} of {len(e['pieces'])} pieces missing ({', '.join(missing)})"
            continue
        tmp = to / (name + ".assembling")
        whole = hashlib.sha256()
        with open(tmp, "wb") as out:
            for p, src in zip(e["pieces"], srcs):
                data = src.read_bytes()
                if hashlib.sha256(data).hexdigest() != p["sha256"]:
                    tmp.unlink()
                    raise CarryError(f"{src}: sha256 differs from the manifest's")
                whole.update(data)
                out.write(data)
        if whole.hexdigest() != e["sha256"]:
            tmp.unlink()
            raise CarryError(f"{name}: the joined pieces' sha256 {whole.hexdigest()} is not the manifest's {e['sha256']}")
        tmp.replace(dst)
        status[name] = f"assembled ({e['bytes'] / MIB:.1f} MiB, sha256 ok)"
    return status


def check_prebuilt(stash: Path) -> str:
    """'' when the stash's prebuilt build is usable here (this Python, this tree's sources), else why not."""
    pre = load_manifest(stash)["extras"].get("prebuilt")
    if not pre:
        return "no prebuilt build was carried"
    tag = python_tag()
    if pre["python_tag"] != tag:
        return f"the prebuilt extension is for {pre['python_tag']}, this Python is {tag}"
    for f in (stash / "prebuilt" / "stowlm-bench", stash / "prebuilt" / pre["extension"]):
        if not f.is_file():
            return f"{f} is missing"
    digest = source_digest()
    if digest != pre["source_digest"]:
        return "the prebuilt build was made from other sources than this tree's (rebuild it here, or build there)"
    return ""


def python_tag() -> str:
    return f"{sys.implementation.name}-{sys.version_info.major}{sys.version_info.minor}"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", help="models to cut into pieces (names of the stowlm cache or paths)")
    ap.add_argument("--dir", default=str(CARRY), help="the carried folder (default .carry/)")
    ap.add_argument("--piece-mib", type=float, default=PIECE_MIB)
    ap.add_argument("--extras", action="store_true", help="gather the peer, shared tools/fixtures and the gguf wheel")
    ap.add_argument("--prebuilt", default=None, metavar="BUILD_DIR", help="with --extras: carry this CUDA build too")
    ap.add_argument("--python-tag", default="cpython-312", help="the device Python's extension tag (default cpython-312)")
    ap.add_argument("--plan", action="store_true", help="print the device calls")
    ap.add_argument("--receive", action="store_true", help="device: move the checked carried files into the stash")
    ap.add_argument("--keep", action="store_true", help="with --receive: copy instead of moving (a dry run here)")
    ap.add_argument("--assemble", action="store_true", help="device: join complete models, sha256 checked")
    ap.add_argument("--check-prebuilt", action="store_true", help="device: exit 0 when the carried build fits here")
    ap.add_argument("--stash", default=None, help="device: where carried files gather (default ~/.cache/stowlm/carried)")
    ap.add_argument("--to", default=None, help="with --assemble: the models folder (default ~/.cache/stowlm/models)")
    a = ap.parse_args(argv)
    carry = Path(a.dir)
    stash = Path(a.stash) if a.stash else default_stash()
    if not (a.models or a.extras or a.plan or a.receive or a.assemble or a.check_prebuilt):
        ap.error("nothing to do: give models to split, or --extras, --plan, --receive, --assemble, --check-prebuilt")
    try:
        if a.models or a.extras:
            m = load_manifest(carry)
            for spec in a.models:
                path = resolve_model(spec)
                m["models"][path.name] = split_model(path, carry, int(a.piece_mib * MIB))
                save_manifest(carry, m)
                e = m["models"][path.name]
                print(f"{path.name}: {e['bytes'] / MIB:.1f} MiB in {len(e['pieces'])} piece(s), sha256 {e['sha256']}")
            if a.extras:
                m["extras"] = gather_extras(carry, Path(a.prebuilt) if a.prebuilt else None, a.python_tag)
                save_manifest(carry, m)
                for name, e in sorted(m["extras"].items()):
                    print(f"{name}: {e['bytes'] / MIB:.2f} MiB")
        if a.plan:
            print_plan(load_manifest(carry), carry)
        if a.receive:
            moved = receive(carry, stash, a.keep)
            print(f"received into {stash}: {', '.join(moved) if moved else 'nothing new'}")
        if a.assemble:
            to = Path(a.to) if a.to else cache_models()
            for name, what in assemble(stash, to, carry).items():
                print(f"{to / name}: {what}")
        if a.check_prebuilt:
            why = check_prebuilt(stash)
            print(f"prebuilt build: {why or 'usable'}")
            return 0 if not why else 3
    except (CarryError, OSError) as e:
        print(f"carry_models: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
