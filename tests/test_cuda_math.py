"""The HOST_DEVICE arithmetic the CUDA kernels run, checked on the CPU (no GPU needed): the
Q8_1 activation quantizer, the weight sub-block unpacking and dp4a dot products of every
quantized weight type, online-softmax updates and the merge of split partials, rope angles,
the KV visibility rule, and router top-k. Oracles: the `gguf` package's numpy dequantizer and
float64 numpy formulas."""
import numpy as np
import pytest

from stowlm import _core
from test_matmul import set_scales

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize  # noqa: E402

cm = _core.cuda_math
T = gguf.GGMLQuantizationType
QTYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ4_XS",
          "MXFP4", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"]


def random_weights(name, rows, cols, rng):
    """Random GGUF bytes (rows, row_bytes) of type `name` and their float64 values."""
    belems, bbytes = gguf.GGML_QUANT_SIZES[T[name]]
    nb = rows * cols // belems
    blocks = rng.integers(0, 256, size=(nb, bbytes), dtype=np.uint8)
    if name == "Q8_K":  # gguf does not decode Q8_K: d (f32) * qs
        blocks[:, 0:4] = rng.uniform(0.001, 0.02, nb).astype(np.float32).view(np.uint8).reshape(nb, 4)
        d = blocks[:, 0:4].copy().view(np.float32).astype(np.float64)
        return blocks.reshape(rows, -1), (d * blocks[:, 4:260].view(np.int8)).reshape(rows, cols)
    set_scales(blocks, name, rng)  # random bytes would give inf/NaN scales
    raw = blocks.reshape(rows, -1)
    return raw, dequantize(raw, T[name]).astype(np.float64).reshape(rows, cols)


def q8_1_reference(x):
    """numpy model of the activation quantizer: d = max|x|/127, q = round half away from zero."""
    xb = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(axis=2)
    d = (amax / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    v = (xb * inv[..., None]).astype(np.float32)
    q = np.clip(np.sign(v) * np.floor(np.abs(v) + np.float32(0.5)), -127, 127).astype(np.int8)
    return q.reshape(x.shape), d


def test_dp4a_matches_bytewise_products():
    rng = np.random.default_rng(0)
    for _ in range(200):
        a, b = (int(v) for v in rng.integers(-2**31, 2**31, 2))
        c = int(rng.integers(-1000, 1000))
        ab = np.array([a], np.int32).view(np.int8).astype(np.int64)
        bb = np.array([b], np.int32).view(np.int8).astype(np.int64)
        assert cm.dp4a(a, b, c) == c + int((ab * bb).sum())


def test_quantize_q8_1_matches_numpy():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 256)) * rng.uniform(0.01, 100, (3, 1))).astype(np.float32)
    x[1, :32] = 0  # all-zero block: d = 0, q = 0
    x[2, 40] = 127 * 0.5  # exact ties at +-0.5 steps round away from zero
    x[2, 41] = -0.5 * (np.abs(x[2, 32:64]).max() / 127)
    qs, d, s = cm.quantize_q8_1(x)
    q_ref, d_ref = q8_1_reference(x)
    np.testing.assert_array_equal(d, d_ref)
    np.testing.assert_array_equal(qs, q_ref)
    sums = qs.reshape(3, -1, 2, 16).astype(np.int64).sum(axis=3)
    np.testing.assert_array_equal(s, (d[..., None] * sums.astype(np.float32)).astype(np.float32))
    assert d[1, 0] == 0 and not qs[1, :32].any()
    # The quantization error is at most half a step.
    assert np.all(np.abs(x - qs * np.repeat(d, 32, axis=1)) <= np.repeat(d, 32, axis=1) * 0.5 * (1 + 1e-6) + 1e-30)


@pytest.mark.parametrize("name", QTYPES)
def test_unpack_row_reproduces_gguf_values(name):
    """d[h] * q + m[h] of every sub-block equals the gguf-decoded weights."""
    rng = np.random.default_rng(2)
    cols = 512
    raw, ref = random_weights(name, 3, cols, rng)
    for r in range(3):
        q, d, m = cm.unpack_row(raw[r], int(T[name]), cols)
        dd = np.repeat(d.astype(np.float64), 16, axis=1).reshape(-1)
        mm = np.repeat(m.astype(np.float64), 16, axis=1).reshape(-1)
        got = dd * q.astype(np.float64) + mm
        np.testing.assert_allclose(got, ref[r], rtol=1e-6, atol=1e-6 * np.abs(ref[r]).max())


@pytest.mark.parametrize("name", QTYPES)
@pytest.mark.parametrize("rows,cols,n_tok", [(5, 256, 1), (9, 512, 8)])
def test_matmul_q8_1_against_dequantized_product(name, rows, cols, n_tok):
    """Sum of per-sub-block dp4a dots == dequantized weights times dequantized activations
    (exact integer parts, so only float rounding differs); and close to the float product."""
    rng = np.random.default_rng(3)
    raw, w = random_weights(name, rows, cols, rng)
    x = rng.standard_normal((n_tok, cols)).astype(np.float32)
    y = cm.matmul_q8_1(raw, int(T[name]), rows, cols, x)
    qs, d, _ = cm.quantize_q8_1(x)
    xq = qs.astype(np.float64) * np.repeat(d.astype(np.float64), 32, axis=1)
    ref = xq @ w.T
    scale = np.abs(w).max() * np.abs(xq).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * scale.max())
    # activation quantization error only: |x - xq| <= d/2 per element
    full = x.astype(np.float64) @ w.T
    bound = (np.abs(w) @ (np.repeat(d.astype(np.float64), 32, axis=1) * 0.5).T).T
    assert np.all(np.abs(y - full) <= bound * 1.001 + 1e-5 * scale)


def test_matmul_q8_1_rejects_bad_input():
    with pytest.raises(ValueError, match="cols=100"):
        cm.matmul_q8_1(np.zeros(18 * 4, np.uint8), int(T.Q4_0), 1, 100, np.zeros((1, 100), np.float32))
    with pytest.raises(ValueError, match="not a quantized weight type"):
        cm.matmul_q8_1(np.zeros(4 * 32, np.uint8), int(T.F32), 1, 32, np.zeros((1, 32), np.float32))
    with pytest.raises(ValueError, match="bytes"):
        cm.matmul_q8_1(np.zeros(17, np.uint8), int(T.Q4_0), 1, 32, np.zeros((1, 32), np.float32))


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 1000])
def test_online_softmax_chunks_merge_to_softmax(chunk):
    rng = np.random.default_rng(4)
    n, dim = 50, 24
    s = (rng.standard_normal(n) * 8).astype(np.float32)
    s[[3, 17, 18]] = -np.inf  # masked cells
    v = rng.standard_normal((n, dim)).astype(np.float32)
    out, m, l = cm.online_softmax_attend(s, v, chunk)
    s64 = s.astype(np.float64)
    p = np.exp(s64 - s64.max())
    np.testing.assert_allclose(out, p @ v / p.sum(), rtol=2e-5, atol=2e-6)
    assert m == pytest.approx(float(s.max()))
    assert l == pytest.approx(float(p.sum()), rel=1e-5)


def test_online_softmax_all_masked_gives_zeros():
    s = np.full(10, -np.inf, np.float32)
    out, m, l = cm.online_softmax_attend(s, np.ones((10, 4), np.float32), 3)
    assert l == 0 and m == -np.inf and not out.any()


def test_online_softmax_large_scores_do_not_overflow():
    s = np.array([1000.0, 999.0, -1000.0, 1001.0], np.float32)
    v = np.eye(4, dtype=np.float32)
    out, _, _ = cm.online_softmax_attend(s, v, 2)
    p = np.exp(s.astype(np.float64) - 1001.0)
    np.testing.assert_allclose(out, p / p.sum(), rtol=1e-5, atol=1e-7)


def test_rope_theta_matches_formula():
    for pos, i, n_rot, base, scale in [(0, 3, 64, 10000.0, 1.0), (17, 0, 64, 10000.0, 1.0),
                                       (4095, 31, 64, 1e6, 0.25), (123, 10, 128, 500000.0, 1.0)]:
        want = pos * scale * base ** (-2.0 * i / n_rot)
        assert cm.rope_theta(pos, i, n_rot, base, scale) == pytest.approx(want, rel=2e-6, abs=1e-6)


def test_kv_visible_rules():
    def ref(q, kv, causal, window):
        return kv != -1 and (not causal or kv <= q) and (window == 0 or q - kv < window)
    for q in range(0, 12):
        for kv in [-1] + list(range(0, 14)):
            for causal in (True, False):
                for window in (0, 1, 4):
                    assert cm.kv_visible(q, kv, causal, window) == ref(q, kv, causal, window), (q, kv, causal, window)


def softmax64(x):
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize("softmax_all,normalize", [(True, False), (True, True), (False, False)])
def test_router_topk_matches_stable_argsort(softmax_all, normalize):
    rng = np.random.default_rng(5)
    for n, k in [(8, 2), (60, 4), (128, 8), (256, 1)]:
        logits = rng.standard_normal(n).astype(np.float32)
        logits[rng.integers(0, n, 5)] = logits[0]  # ties: lower expert index first
        ids, w = cm.router_topk(logits, k, softmax_all, normalize)
        want = np.argsort(-logits.astype(np.float64), kind="stable")[:k]
        np.testing.assert_array_equal(ids, want)
        l64 = logits.astype(np.float64)
        ww = softmax64(l64)[want] if softmax_all else softmax64(l64[want])
        if normalize:
            ww = ww / ww.sum()
        np.testing.assert_allclose(w, ww, rtol=1e-5)


def test_router_topk_all_equal_and_nan():
    ids, w = cm.router_topk(np.zeros(6, np.float32), 3)
    np.testing.assert_array_equal(ids, [0, 1, 2])
    np.testing.assert_allclose(w, [1 / 6] * 3, rtol=1e-6)
    ids, _ = cm.router_topk(np.array([np.nan, 1.0, np.nan, 2.0], np.float32), 2, False)
    np.testing.assert_array_equal(ids, [3, 1])
    with pytest.raises(ValueError, match="k=5"):
        cm.router_topk(np.zeros(4, np.float32), 5)


@pytest.mark.parametrize("sigmoid,normalize,scale", [(False, False, 0.0), (False, True, 0.0), (True, True, 2.5),
                                                     (True, False, 1.0)])
def test_top_k_and_moe_weights_match_numpy(sigmoid, normalize, scale):
    """The TOP_K and MOE_WEIGHTS ops of the CUDA backend (router_top_ids, moe_gate_weights) against
    a stable argsort and float64 gates with cpu::moe_weights' rules."""
    rng = np.random.default_rng(7)
    for n, k in [(1, 1), (8, 2), (60, 4), (128, 8)]:
        logits = (3 * rng.standard_normal((5, n))).astype(np.float32)
        logits[:, rng.integers(0, n, 3)] = logits[:, :1]  # ties: lower index first
        if n > 1:
            logits[4] = -30.0 - np.arange(n, dtype=np.float32) / n  # sigmoid gates sum below the 2^-14 clamp
        ids, w = cm.top_k_moe_weights(logits, k, sigmoid, normalize, scale)
        want = np.argsort(-logits.astype(np.float64), axis=1, kind="stable")[:, :k]
        np.testing.assert_array_equal(ids, want)
        l64 = logits.astype(np.float64)
        gate = 1 / (1 + np.exp(-l64)) if sigmoid else np.stack([softmax64(r) for r in l64])
        ww = np.take_along_axis(gate, want, axis=1)
        if normalize:
            ww = ww / np.maximum(ww.sum(axis=1, keepdims=True), 2.0**-14)
        if scale not in (0.0, 1.0):
            ww = ww * scale
        np.testing.assert_allclose(w, ww, rtol=2e-5, atol=1e-30)
