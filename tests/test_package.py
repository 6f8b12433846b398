import stowlm
from stowlm import _core


def test_types_table_matches_gguf():
    gguf = __import__("gguf")
    ours = _core.qtypes()
    for name, (tid, elems, nbytes) in ours.items():
        t = gguf.GGMLQuantizationType[name]
        assert int(t) == tid
        assert gguf.GGML_QUANT_SIZES[t] == (elems, nbytes), name
    assert stowlm.__version__


def test_the_version_is_pyprojects():
    import tomllib
    from pathlib import Path

    meta = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert stowlm.__version__ == meta["project"]["version"]  # stowlm/version.py, read by the server and the CLI
