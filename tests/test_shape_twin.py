"""bench/shape_twin.py: a model's header carried to a GPU machine and its weights made random
there, for speed figures of models too big to carry. The twin must be the model's layout byte
for byte up to the weights (same tensors, types, shapes, offsets, size), and its weights finite
and O(1/sqrt(fan_in)) when the `gguf` package dequantizes them (the independent oracle)."""
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

import stowlm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import shape_twin  # noqa: E402


@pytest.mark.parametrize("kind", [k for k, b in shape_twin.BLOCKS.items() if b[1] > 1])
def test_each_formats_random_blocks_dequantize_to_the_wanted_spread(kind):
    fan_in = 1024
    b = shape_twin.blocks(kind, 512, fan_in, np.random.default_rng(0))
    w = gguf.quants.dequantize(b.reshape(-1), gguf.GGMLQuantizationType(kind))
    want = 1 / np.sqrt(fan_in)
    assert np.isfinite(w).all()
    assert 0.5 * want < w.std() < 2 * want, (shape_twin.BLOCKS[kind][0], w.std(), want)
    assert abs(w.mean()) < 0.3 * want


def test_the_twin_has_the_models_layout_and_runs(model_path, tmp_path):
    real = model_path("smollm2-135m")
    twin_file, out = tmp_path / "m.twin", tmp_path / "twin.gguf"
    shape_twin.main(["save", str(real), str(twin_file)])
    assert twin_file.stat().st_size < 0.05 * real.stat().st_size  # what a device call carries
    shape_twin.main(["fill", str(twin_file), str(out)])
    assert out.stat().st_size == real.stat().st_size
    a, b = gguf.GGUFReader(str(real)), gguf.GGUFReader(str(out))
    assert a.data_offset == b.data_offset
    assert real.read_bytes()[:a.data_offset] == out.read_bytes()[:b.data_offset]
    key = lambda r: [(t.name, int(t.tensor_type), list(t.shape), int(t.data_offset)) for t in r.tensors]
    assert key(a) == key(b)
    assert not np.array_equal(np.asarray(a.tensors[5].data), np.asarray(b.tensors[5].data))  # random, not copied
    m = stowlm.Model(str(out), devices=["cpu:0[threads=1]"])
    logits = stowlm.Context(m, n_ctx=64, n_ubatch=8).eval([1, 2, 3, 4], logits="all")
    assert np.isfinite(logits).all() and logits.std() > 0


def test_a_file_that_is_no_twin_is_refused(tmp_path):
    import lzma

    bad = tmp_path / "x.twin"
    with lzma.open(bad, "wb") as f:
        f.write(b"not a twin")
    with pytest.raises(SystemExit, match="not a twin file"):
        shape_twin.fill(bad, tmp_path / "out.gguf")
