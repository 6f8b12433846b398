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


# ---- the ops of gpt-oss, deepseek2 and glm4moe, several sequences ------------------------------

@pytest.mark.parametrize("n_rot,base,factor,attn,n_ctx_orig", [
    (64, 150000.0, 32.0, 1.0, 4096),    # gpt-oss
    (32, 10000.0, 40.0, 0.7305, 4096),  # deepseek2's rope dims
    (64, 1e6, 4.0, 1.2, 8192),
])
def test_rope_angles_of_the_cuda_kernel_match_yarn(n_rot, base, factor, attn, n_ctx_orig):
    """The rope kernel's angle and cos/sin magnitude per pair (rope_pair_angle with the launcher's
    YaRN set-up) against ggml's rope_yarn in float64; plain RoPE keeps rope_theta and magnitude 1."""
    pos = np.array([0, 1, 17, 500, 2100, 4095, 30000], np.int32)
    th, ms = cm.rope_angles(pos, n_rot, base, 1 / factor, 1.0, attn, 32.0, 1.0, n_ctx_orig)
    half = n_rot // 2

    def corr(n_turns):
        return n_rot * np.log(n_ctx_orig / (n_turns * 2 * np.pi)) / (2 * np.log(base))
    lo, hi = max(0.0, np.floor(corr(32.0))), min(n_rot - 1.0, np.ceil(corr(1.0)))
    i = np.arange(half)
    extrap = pos[:, None].astype(np.float64) * base ** (-2.0 * i / n_rot)
    ramp = 1 - np.clip((i - lo) / max(0.001, hi - lo), 0, 1)
    theta = extrap / factor * (1 - ramp) + extrap * ramp
    m = attn * (1 + 0.1 * np.log(factor))
    np.testing.assert_allclose(ms, np.full_like(theta, m), rtol=1e-6)
    # float angles lose ~6e-8 x the angle; compare what the kernel uses: cos and sin
    np.testing.assert_allclose(np.cos(th.astype(np.float64)), np.cos(theta), atol=3e-4 + 1e-7 * np.abs(theta).max())
    np.testing.assert_allclose(np.sin(th.astype(np.float64)), np.sin(theta), atol=3e-4 + 1e-7 * np.abs(theta).max())
    th, ms = cm.rope_angles(pos, n_rot, base, 0.5)
    assert np.all(ms == 1)
    for t in range(len(pos)):
        for j in (0, half // 2, half - 1):
            assert th[t, j] == cm.rope_theta(int(pos[t]), j, n_rot, base, 0.5)


def attend_ref(s, v, sink=None):
    s64 = s.astype(np.float64)
    vis = s64 != -np.inf
    if not vis.any() and sink is None:
        return np.zeros(v.shape[1])
    m = max(s64[vis].max() if vis.any() else -np.inf, -np.inf if sink is None else sink)
    p = np.where(vis, np.exp(s64 - m), 0.0)
    den = p.sum() + (0.0 if sink is None else np.exp(sink - m))
    return p @ v.astype(np.float64) / den


@pytest.mark.parametrize("split_len", [3, 8, 64, 1000])
@pytest.mark.parametrize("sink", [None, 1.5, -20.0])
def test_attention_splits_fold_to_softmax(split_len, sink):
    """The attention kernel's arithmetic (4 interleaved warps per split, the splits folded in order,
    the sink in the denominator) is the softmax; folding as the splits come and folding stored
    partials (the blocks-per-split launch and its combine kernel) give the same bits."""
    rng = np.random.default_rng(20)
    n, dim = 200, 40
    s = (rng.standard_normal(n) * 6).astype(np.float32)
    s[rng.integers(0, n, 30)] = -np.inf
    v = rng.standard_normal((n, dim)).astype(np.float32)
    for lo, hi in [(0, n), (64, 128), (13, 14), (50, 50)]:
        one = cm.attend_splits(s, v, split_len, lo, hi, sink)
        both = cm.attend_splits(s, v, split_len, lo, hi, sink, stored_partials=True)
        np.testing.assert_array_equal(one, both)
        win = np.full(n, -np.inf, np.float32)
        win[lo:hi] = s[lo:hi]
        np.testing.assert_allclose(one, attend_ref(win, v, sink), rtol=3e-5, atol=3e-6)


def test_attention_of_a_sequence_does_not_depend_on_the_others():
    """A query of the sequence owning cells [lo, hi) gets the same bits whatever the other regions
    hold and however many cells the batch spans, as the fixed splits start at multiples of the
    split length: the CUDA kernel's batch independence on several sequences."""
    rng = np.random.default_rng(21)
    seq_cells, split, dim = 256, 128, 32
    region = (rng.standard_normal(seq_cells) * 4).astype(np.float32)
    region[150:] = -np.inf  # cells the sequence has not filled yet
    vals = rng.standard_normal((seq_cells, dim)).astype(np.float32)
    outs = []
    for n_regions, r in [(1, 0), (4, 2), (3, 2), (4, 1)]:
        s = (rng.standard_normal(n_regions * seq_cells) * 4).astype(np.float32)  # other sequences' cells
        v = rng.standard_normal((n_regions * seq_cells, dim)).astype(np.float32)
        lo, hi = cm.attn_seq_region(r, seq_cells, len(s))
        assert (lo, hi) == (r * seq_cells, (r + 1) * seq_cells)
        s[lo:hi], v[lo:hi] = region, vals
        for stored in (False, True):
            outs.append(cm.attend_splits(s, v, split, lo, hi, 0.5, stored_partials=stored))
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
    assert cm.attn_seq_region(3, 256, 900) == (768, 900)  # the last region cut by the span
    assert cm.attn_seq_region(5, 0, 900) == (0, 900)      # no regions: every cell


SELECT_CASES = [(0, False, (0, 0), 16, 6), (1, True, (0, 0), 16, 6), (1, True, (4, 3), 16, 6),
                (2, False, (0, 0), 32, 4), (0, True, (4, 2), 16, 6), (1, True, (8, 4), 256, 8),
                (1, False, (0, 0), 128, 4), (1, True, (1, 1), 64, 8)]


@pytest.mark.parametrize("gating,use_bias,groups,n,k", SELECT_CASES)
def test_expert_selection_matches_the_cpu_op(gating, use_bias, groups, n, k):
    """The CUDA TOP_K's selection (moe_select.h: gated score + bias, the best groups by their two
    best scores, ties to the lower id) gives cpu::top_k's ids."""
    rng = np.random.default_rng(22 + n + gating)
    x = (rng.standard_normal((60, n)) * 3).astype(np.float32)
    x[:, 5] = x[:, 9]  # ties
    x[7] = 0.0         # a row of ties
    bias = (rng.standard_normal(n) * 0.5).astype(np.float32) if use_bias else None
    got = cm.expert_select(x, k, gating, bias, *groups)
    np.testing.assert_array_equal(got, _core.ops.top_k(x, k, gating, bias, *groups))


@pytest.mark.parametrize("gating", [0, 1, 2])
@pytest.mark.parametrize("normalize,scale", [(False, 0.0), (True, 2.5)])
def test_gate_weights_match_the_cpu_op(gating, normalize, scale):
    """The CUDA MOE_WEIGHTS (moe_gate_weights_any: softmax over all, a sigmoid each, a softmax over
    the picked) gives cpu::moe_weights' weights."""
    rng = np.random.default_rng(23)
    logits = (rng.standard_normal((40, 32)) * 3).astype(np.float32)
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :4].astype(np.int32)
    ids[3] = [7, 2, 30, 0]  # any order
    got = cm.gate_weights(logits, ids, gating, normalize, scale)
    want = _core.ops.moe_weights(logits, ids, gating, normalize, scale)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)
    if gating == 2 and not normalize:
        picked = np.take_along_axis(logits.astype(np.float64), ids, 1)
        ref = np.exp(picked - picked.max(1, keepdims=True))
        np.testing.assert_allclose(got, ref / ref.sum(1, keepdims=True), rtol=1e-6)


def test_expert_selection_rejects_bad_groups():
    with pytest.raises(ValueError, match="groups"):
        cm.expert_select(np.zeros((1, 16), np.float32), 6, 1, None, 5, 2)
    with pytest.raises(ValueError, match="groups"):
        cm.expert_select(np.zeros((1, 16), np.float32), 6, 1, None, 4, 1)


# ---- tensor parallelism (collective_math.h) -----------------------------------------------

def _sequential_sum(parts):
    out = np.zeros(parts.shape[1], np.float32) if len(parts) == 0 else parts[0].copy()
    for p in parts[1:]:
        out = (out + p).astype(np.float32)
    return out


@pytest.mark.parametrize("n_parts", [0, 1, 2, 3, 5, 16])
def test_all_reduce_sum_is_the_float32_sum_in_shard_order(n_parts):
    """What every shard of an all-reduce computes, the CPU backend and the CUDA kernel alike:
    ((p0 + p1) + p2) + ..., one float32 add at a time, so all shards hold the same bits."""
    rng = np.random.default_rng(40 + n_parts)
    scale = 10.0 ** rng.uniform(-4, 4, (n_parts, 1))
    parts = (rng.standard_normal((n_parts, 3001)) * scale).astype(np.float32)
    if n_parts:
        parts[0, :3] = [-0.0, np.inf, np.nan]  # -0 kept, inf and nan carried
    got = cm.shard_order_sum(parts)
    np.testing.assert_array_equal(got.view(np.uint32), _sequential_sum(parts).view(np.uint32))


def test_all_reduce_sum_order_matters():
    """The order is the contract: another order gives other bits."""
    parts = np.array([[1e8, 1.0], [1.0, 1e8], [-1e8, -1e8]], np.float32)
    np.testing.assert_array_equal(cm.shard_order_sum(parts), [0.0, 0.0])   # 1e8 + 1 rounds to 1e8
    np.testing.assert_array_equal(cm.shard_order_sum(parts[[0, 2, 1]]), [1.0, 0.0])


@pytest.mark.parametrize("widths", [[5], [3, 0, 4], [0, 7], [1] * 16, [64, 32, 96]])
def test_all_gather_places_each_shards_rows(widths):
    """ALL_GATHER (the CUDA kernel's arithmetic; the CPU backend copies the same layout): every
    column of the output is the shards' rows of that column in shard order, bits untouched."""
    rng = np.random.default_rng(sum(widths))
    cols = 37
    parts = [rng.standard_normal((cols, w)).astype(np.float32) for w in widths]
    parts[-1].reshape(-1)[:2] = [-0.0, np.nan]  # carried as they are
    flat = np.concatenate([p.reshape(-1) for p in parts])
    got = cm.gather_rows(flat, widths, cols)
    np.testing.assert_array_equal(got.view(np.uint32), np.concatenate(parts, axis=1).view(np.uint32))


def test_local_expert_ids():
    """LOCAL_IDS: the ids of experts [first, first + count) renumbered from 0, every other -1 (the
    -1 of a slot routed to no expert stays -1), without overflow near the int32 limits."""
    ids = np.array([-1, 0, 3, 4, 7, 8, 11, 12, 40, 2**31 - 1, -2**31], np.int32)
    np.testing.assert_array_equal(cm.local_expert_ids(ids, 4, 8), np.where((ids >= 4) & (ids < 12), ids - 4, -1))
    np.testing.assert_array_equal(cm.local_expert_ids(ids, 0, 0), np.full(len(ids), -1))
    np.testing.assert_array_equal(cm.local_expert_ids(ids, 2**31 - 8, 8), [-1] * 9 + [7, -1])
