"""CPU ops (stowlm._core.ops) against numpy float64 references and the gguf package's codecs,
on every instruction-set path this CPU has (scalar, AVX2, AVX-512)."""
import numpy as np
import pytest
from gguf import quants as gq
from gguf.constants import GGMLQuantizationType as GT

from stowlm import _core
from stowlm import ops as stowlm_ops
from stowlm._core import ops

ISAS = ["scalar", "avx2", "avx512"]


@pytest.fixture(params=ISAS)
def isa(request):
    info = stowlm_ops.cpu_info()
    if request.param not in info["supported"]:
        pytest.skip(f"CPU has no {request.param}")
    stowlm_ops.set_isa(request.param)
    assert ops.ops_isa() == request.param
    yield request.param
    stowlm_ops.set_isa(info["best"])


def rng(seed=0):
    return np.random.default_rng(seed)


# ---- rms_norm / elementwise --------------------------------------------------------------

@pytest.mark.parametrize("n,dim", [(1, 1), (3, 5), (2, 33), (4, 130), (1, 576)])
def test_rms_norm(isa, n, dim):
    r = rng(dim)
    x = r.standard_normal((n, dim)).astype(np.float32)
    w = r.standard_normal(dim).astype(np.float32)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(ops.rms_norm(x, w, 1e-6), ref * w, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(ops.rms_norm(x, None, 1e-6), ref, rtol=2e-5, atol=2e-6)


def test_rms_norm_bad_weight():
    with pytest.raises(ValueError, match="weight"):
        ops.rms_norm(np.ones((2, 8), np.float32), np.ones(7, np.float32), 1e-6)


@pytest.mark.parametrize("shape", [(1, 5), (3, 33), (2, 130), (70, 600)])
def test_activations(isa, shape):
    r = rng(shape[1])
    g = (r.standard_normal(shape) * 3).astype(np.float32)
    # the ends of the vector exp's range (clamped inputs, underflow) and the tails of each row
    extremes = np.array([-200, -104, -90, -88, -30, 30, 88, 90, 200], np.float32)
    g.flat[-len(extremes):] = extremes[:g.size]
    u = r.standard_normal(shape).astype(np.float32)
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    silu = g64 / (1 + np.exp(-g64))
    np.testing.assert_allclose(ops.swiglu(g, u), silu * u64, rtol=1e-5, atol=1e-6)
    gelu = 0.5 * g64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (g64 + 0.044715 * g64 ** 3)))
    np.testing.assert_allclose(ops.geglu(g, u), gelu * u64, rtol=1e-5, atol=1e-6)


def test_activations_extremes(isa):
    """Large |gate| saturates to the limits (0 or the gate itself), never inf or NaN."""
    g = np.array([-1e4, -1000, -104, -100, -90, -88.5, -60, -20, -1e-6, 0, 1e-6, 20, 60, 88.5, 90, 100, 1000, 1e4,
                  -3.5, 3.5], np.float32)
    u = np.linspace(-2, 2, g.size).astype(np.float32)
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    silu = g64 * 0.5 * (1 + np.tanh(g64 / 2))  # x * sigmoid(x) without overflow
    np.testing.assert_allclose(ops.swiglu(g[None], u[None])[0], silu * u64, rtol=1e-5, atol=1e-6)
    gelu = 0.5 * g64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (g64 + 0.044715 * g64 ** 3)))
    np.testing.assert_allclose(ops.geglu(g[None], u[None])[0], gelu * u64, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 1), (3, 33), (5, 130), (64, 1024)])
def test_elementwise(isa, shape):
    r = rng(shape[0])
    a = r.standard_normal(shape).astype(np.float32)
    b = r.standard_normal(shape).astype(np.float32)
    row = r.standard_normal(shape[1]).astype(np.float32)
    np.testing.assert_array_equal(ops.add(a, b), a + b)
    np.testing.assert_array_equal(ops.mul(a, b), a * b)
    np.testing.assert_array_equal(ops.add(a, row), a + row[None, :])
    np.testing.assert_array_equal(ops.mul(a, row), a * row[None, :])
    np.testing.assert_allclose(ops.scale(a, 0.37), a.astype(np.float64) * np.float32(0.37), rtol=1e-6)
    x = a * 40
    np.testing.assert_allclose(ops.softcap(x, 30.0), 30 * np.tanh(x.astype(np.float64) / 30), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        ops.add(a, b[:, :-1] if shape[1] > 1 else np.ones((shape[0], 2), np.float32))


# ---- rope ----------------------------------------------------------------------------------

def rope_ref(x, pos, n_rot, base, scale, neox):
    y = x.astype(np.float64).copy()
    half = n_rot // 2
    i = np.arange(half)
    theta = pos[:, None].astype(np.float64) * scale * base ** (-2.0 * i / n_rot)  # [tok, half]
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    if neox:
        x0, x1 = y[..., :half].copy(), y[..., half:n_rot].copy()
        y[..., :half] = x0 * c - x1 * s
        y[..., half:n_rot] = x0 * s + x1 * c
    else:
        x0, x1 = y[..., 0:n_rot:2].copy(), y[..., 1:n_rot:2].copy()
        y[..., 0:n_rot:2] = x0 * c - x1 * s
        y[..., 1:n_rot:2] = x0 * s + x1 * c
    return y


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("n_tok,n_head,hd,n_rot,base,scale", [
    (1, 1, 64, 64, 10000.0, 1.0),
    (5, 3, 64, 32, 10000.0, 1.0),     # n_rot < head_dim: the rest is untouched
    (7, 9, 80, 80, 100000.0, 0.25),
    (3, 2, 128, 96, 1000000.0, 1.0),
    (2, 4, 256, 256, 10000.0, 0.5),
])
def test_rope(isa, neox, n_tok, n_head, hd, n_rot, base, scale):
    r = rng(hd + n_rot)
    x = r.standard_normal((n_tok, n_head, hd)).astype(np.float32)
    pos = np.sort(r.integers(0, 1200, n_tok)).astype(np.int32)
    got = ops.rope(x, pos, n_rot, base, scale, neox)
    ref = rope_ref(x, pos, n_rot, base, scale, neox)
    np.testing.assert_allclose(got, ref, rtol=0, atol=5e-4)
    np.testing.assert_array_equal(got[..., n_rot:], x[..., n_rot:])


def test_rope_repeated_calls_follow_positions_and_params():
    # The cos/sin table is reused between calls with the same positions; any change must show.
    r = rng(3)
    x = r.standard_normal((4, 2, 64)).astype(np.float32)
    a = np.array([5, 6, 7, 8], np.int32)
    b = np.array([5, 6, 7, 9], np.int32)
    for pos, base, scale, n_rot in [(a, 1e4, 1.0, 64), (a, 1e4, 1.0, 64), (b, 1e4, 1.0, 64), (b, 5e5, 1.0, 64),
                                    (b, 5e5, 0.5, 64), (b, 5e5, 0.5, 32), (a[:3], 1e4, 1.0, 64)]:
        got = ops.rope(x[:len(pos)], pos, n_rot, base, scale, False)
        np.testing.assert_allclose(got, rope_ref(x[:len(pos)], pos, n_rot, base, scale, False), atol=5e-5)


def test_rope_bad_n_rot():
    x = np.ones((1, 1, 64), np.float32)
    with pytest.raises(ValueError, match="n_rot"):
        ops.rope(x, np.zeros(1, np.int32), 33)
    with pytest.raises(ValueError, match="n_rot"):
        ops.rope(x, np.zeros(1, np.int32), 66)
    with pytest.raises(ValueError, match="pos"):
        ops.rope(x, np.zeros(2, np.int32), 64)


# ---- KV store / flash attention ------------------------------------------------------------

def q8_0_roundtrip(x):
    hd = x.shape[-1]
    flat = x.reshape(-1, hd).astype(np.float32)
    return gq.dequantize(gq.quantize(flat, GT.Q8_0), GT.Q8_0).reshape(x.shape).astype(np.float64)


def kv_values(x, kv_type):
    return x.astype(np.float16).astype(np.float64) if kv_type == "F16" else q8_0_roundtrip(x)


def attn_ref(q, k, v, q_pos, kv_pos, scale, softcap, window, causal, kv_type):
    k64, v64 = kv_values(k, kv_type), kv_values(v, kv_type)
    n_tok, n_head, hd = q.shape
    n_rep = n_head // k.shape[1]
    qp, kp = q_pos[:, None].astype(np.int64), kv_pos[None, :].astype(np.int64)
    vis = np.broadcast_to(kp >= 0, (len(q_pos), len(kv_pos))).copy()
    if causal:
        vis &= kp <= qp
    if window:
        vis &= (qp - kp) < window
    out = np.zeros((n_tok, n_head, hd))
    for h in range(n_head):
        g = h // n_rep
        s = q[:, h, :].astype(np.float64) @ k64[:, g, :].T * scale
        if softcap:
            s = softcap * np.tanh(s / softcap)
        s = np.where(vis, s, -np.inf)
        m = s.max(axis=1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0)
        p = np.exp(s - m)
        l = p.sum(axis=1, keepdims=True)
        out[:, h, :] = np.where(l > 0, (p @ v64[:, g, :]) / np.where(l > 0, l, 1), 0)
    return out


def run_attn(r, n_tok, n_head, n_head_kv, hd, q_pos, kv_pos, kv_type="F16", scale=None, softcap=0.0, window=0,
             causal=True, k_f16_input=False, threads=0):
    q = r.standard_normal((n_tok, n_head, hd)).astype(np.float32)
    k = r.standard_normal((len(kv_pos), n_head_kv, hd)).astype(np.float32)
    v = r.standard_normal((len(kv_pos), n_head_kv, hd)).astype(np.float32)
    scale = 1.0 / np.sqrt(hd) if scale is None else scale
    q_pos = np.asarray(q_pos, np.int32)
    kv_pos = np.asarray(kv_pos, np.int32)
    kk, vv = (k.astype(np.float16), v.astype(np.float16)) if k_f16_input else (k, v)
    got = ops.flash_attn(q, kk, vv, q_pos, kv_pos, scale, softcap, window, causal, kv_type, threads)
    ref = attn_ref(q, k, v, q_pos, kv_pos, scale, softcap, window, causal, kv_type)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=2e-5)
    return got, ref


@pytest.mark.parametrize("hd", [36, 64, 80, 128, 256])
@pytest.mark.parametrize("n_head,n_head_kv", [(2, 2), (9, 3), (7, 1)])
def test_attn_prompt_causal(isa, hd, n_head, n_head_kv):
    n = 5
    run_attn(rng(hd + n_head), n, n_head, n_head_kv, hd, np.arange(n), np.arange(n))


@pytest.mark.parametrize("kv_type", ["F16", "Q8_0"])
@pytest.mark.parametrize("n_tok", [1, 7, 33])
def test_attn_later_batch_shuffled_cells(isa, kv_type, n_tok):
    # 1000 cells (not a multiple of the KV block) holding positions 0..979 in shuffled order plus
    # 20 empty ones; queries at 600.. see only part of them; n_tok=1 takes the KV-split path.
    r = rng(n_tok)
    kv_pos = np.concatenate([np.arange(980), -np.ones(20, np.int64)])
    r.shuffle(kv_pos)
    q_pos = 600 + np.arange(n_tok)
    run_attn(r, n_tok, 6, 2, 64, q_pos, kv_pos, kv_type=kv_type)


@pytest.mark.parametrize("window", [1, 2, 17, 128, 129])
def test_attn_sliding_window(isa, window):
    r = rng(window)
    n_kv = 300
    q_pos = np.array([0, 1, 128, 129, 200, 299])
    run_attn(r, len(q_pos), 4, 2, 64, q_pos, np.arange(n_kv), window=window)


def test_attn_window_boundary_exact(isa):
    # q at 10, window 4: keys 7..10 visible, 6 (q - k == window) not. Values v = one-hot of position
    # so the output shows which keys got weight.
    hd = 64
    kv_pos = np.arange(12, dtype=np.int32)
    k = np.zeros((12, 1, hd), np.float32)
    v = np.zeros((12, 1, hd), np.float32)
    v[np.arange(12), 0, np.arange(12)] = 1
    q = np.zeros((1, 1, hd), np.float32)
    out = ops.flash_attn(q, k, v, np.array([10], np.int32), kv_pos, 1.0, 0.0, 4, True, "F16")
    expect = np.zeros(hd)
    expect[7:11] = 0.25
    np.testing.assert_allclose(out[0, 0], expect, atol=1e-7)


def test_attn_empty_and_invisible(isa):
    # All cells empty except positions after the query: output is zeros, not NaN.
    r = rng(5)
    got, _ = run_attn(r, 2, 2, 1, 64, [3, 4], [-1, 9, -1, 7])
    assert np.all(got == 0)


@pytest.mark.parametrize("kv_type", ["F16", "Q8_0"])
def test_attn_softcap_noncausal_gqa7(isa, kv_type):
    r = rng(11)
    run_attn(r, 9, 7, 1, 128, np.arange(9) + 50, np.arange(300), kv_type=kv_type, scale=0.5, softcap=5.0,
             causal=False)


@pytest.mark.parametrize("hd,n_head,n_head_kv", [(64, 9, 3), (80, 4, 2), (128, 14, 2), (256, 4, 1), (36, 4, 2)])
def test_attn_prompt_many_tokens(isa, hd, n_head, n_head_kv):
    # 24+ query tokens: the blocked many-token path on AVX-512 (query tiles of up to 64 rows of
    # tokens x heads, KV blocks of 64 cells), with a token count that leaves a partial tile, a
    # second batch after a shuffled cache with empty cells, and a sliding window.
    r = rng(hd + n_head)
    n = 77
    run_attn(r, n, n_head, n_head_kv, hd, np.arange(n), np.arange(n))
    kv_pos = np.concatenate([np.arange(150), -np.ones(11, np.int64)])
    r.shuffle(kv_pos)
    run_attn(r, 30, n_head, n_head_kv, hd, 120 + np.arange(30), kv_pos)
    run_attn(r, 40, n_head, n_head_kv, hd, np.arange(40) + 100, np.arange(140), window=33)


def test_attn_prompt_many_tokens_softcap_invisible(isa):
    # Non-causal with a soft cap over 24+ tokens; then queries before every stored position
    # (nothing visible: zeros, not NaN) next to ones that see part of the cache.
    r = rng(3)
    run_attn(r, 26, 7, 1, 128, np.arange(26) + 50, np.arange(300), scale=0.5, softcap=5.0, causal=False)
    got, _ = run_attn(r, 28, 4, 2, 64, np.arange(28), np.arange(70) + 12)
    assert np.all(got[:12] == 0) and np.all(np.isfinite(got))


@pytest.mark.parametrize("n_kv", [1, 130, 4096])
def test_attn_decode(isa, n_kv):
    r = rng(n_kv)
    run_attn(r, 1, 9, 3, 64, [n_kv - 1], np.arange(n_kv), k_f16_input=True)


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("kv_type", ["F16", "Q8_0"])
def test_attn_decode_kv_split_threads(isa, threads, kv_type):
    # Single-token decoding splits the KV range across the pool's threads and merges the partial
    # softmax states; uneven splits, empty cells and a window cutting across splits included.
    r = rng(threads)
    n_kv = 2000
    kv_pos = np.arange(n_kv)
    kv_pos[r.choice(n_kv, 50, replace=False)] = -1
    run_attn(r, 1, 4, 2, 64, [n_kv - 1], kv_pos, kv_type=kv_type, threads=threads)
    run_attn(r, 2, 4, 2, 64, [1500, 1501], kv_pos, kv_type=kv_type, window=700, threads=threads)


def test_attn_bad_input():
    q = np.zeros((2, 4, 64), np.float32)
    k = np.zeros((8, 2, 64), np.float32)
    pos2, pos8 = np.zeros(2, np.int32), np.zeros(8, np.int32)
    with pytest.raises(ValueError, match="q_pos"):
        ops.flash_attn(q, k, k, pos8, pos8, 1.0)
    with pytest.raises(ValueError, match="kv_pos"):
        ops.flash_attn(q, k, k, pos2, pos2, 1.0)
    with pytest.raises(ValueError, match="heads"):
        ops.flash_attn(np.zeros((2, 3, 64), np.float32), k, k, pos2, pos8, 1.0)
    with pytest.raises(ValueError, match="kv_type"):
        ops.flash_attn(q, k, k, pos2, pos8, 1.0, kv_type="Q4_0")
    with pytest.raises(ValueError, match="v"):
        ops.flash_attn(q, k, k[:4], pos2, pos8, 1.0)
    with pytest.raises(ValueError, match="block size"):
        ops.flash_attn(np.zeros((2, 4, 80), np.float32), np.zeros((8, 2, 80), np.float32),
                       np.zeros((8, 2, 80), np.float32), pos2, pos8, 1.0, kv_type="Q8_0")


@pytest.mark.parametrize("hd,n_head_kv", [(64, 3), (80, 1), (256, 2)])
def test_store_kv(isa, hd, n_head_kv):
    r = rng(hd)
    x = (r.standard_normal((3, n_head_kv, hd)) * 4).astype(np.float32)
    cells = np.array([5, 0, 2], np.int32)
    cache = np.zeros((6, n_head_kv * hd * 2), np.uint8)
    ops.store_kv(x, "F16", cache, cells)
    np.testing.assert_array_equal(cache.view(np.float16).reshape(6, n_head_kv, hd)[cells], x.astype(np.float16))
    assert not cache[[1, 3, 4]].any()
    if hd % 32 == 0:
        rb = hd // 32 * 34
        cache = np.zeros((6, n_head_kv * rb), np.uint8)
        ops.store_kv(x, "Q8_0", cache, cells)
        ref = gq.quantize(x.reshape(-1, hd), GT.Q8_0).reshape(3, n_head_kv * rb)
        np.testing.assert_array_equal(cache[cells], ref)
    with pytest.raises(ValueError, match="cell"):
        ops.store_kv(x, "F16", np.zeros((5, n_head_kv * hd * 2), np.uint8), np.array([5, 0, 2], np.int32))


# ---- get_rows ---------------------------------------------------------------------------------

# byte offsets of the fp16 scale fields inside one block, so random blocks decode to finite values
HALF_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "IQ4_NL": [0],
               "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0]}


def random_rows(r, name, n_rows, n_cols):
    _, block_elems, block_bytes = _core.qtypes()[name]
    if name == "F32":
        return r.standard_normal((n_rows, n_cols)).astype(np.float32).view(np.uint8)
    if name == "F16":
        return r.standard_normal((n_rows, n_cols)).astype(np.float16).view(np.uint8)
    if name == "BF16":
        f = r.standard_normal((n_rows, n_cols)).astype(np.float32).view(np.uint32)
        return (f >> 16).astype(np.uint16).view(np.uint8)
    nb = n_cols // block_elems
    raw = r.integers(0, 256, (n_rows, nb, block_bytes), dtype=np.uint8)
    for off in HALF_FIELDS[name]:
        h = (r.standard_normal((n_rows, nb)) * 0.1).astype(np.float16)
        raw[:, :, off:off + 2] = h.view(np.uint8).reshape(n_rows, nb, 2)
    return raw.reshape(n_rows, nb * block_bytes)


GET_ROWS_TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                  "IQ4_NL", "IQ4_XS"]


@pytest.mark.parametrize("name", GET_ROWS_TYPES)
def test_get_rows(name):
    if name not in _core.qtypes():
        pytest.skip(f"{name} not supported by this build")
    r = rng(len(name))
    block_elems = _core.qtypes()[name][1]
    n_cols = 33 if block_elems == 1 else 2 * block_elems
    raw = random_rows(r, name, 7, n_cols)
    ids = np.array([6, 0, 3, 3, 1], np.int32)
    got = ops.get_rows(raw, name, ids, n_cols)
    ref = gq.dequantize(raw, GT[name]).astype(np.float32).reshape(7, n_cols)
    np.testing.assert_allclose(got, ref[ids], rtol=1e-6, atol=1e-7)


def test_get_rows_bad_ids():
    raw = np.zeros((4, 32 * 2), np.uint8)
    with pytest.raises(ValueError, match="id 4"):
        ops.get_rows(raw, "F16", np.array([0, 4], np.int32), 32)
    with pytest.raises(ValueError, match="id -1"):
        ops.get_rows(raw, "F16", np.array([-1], np.int32), 32)
    with pytest.raises(ValueError, match="block size"):
        ops.get_rows(raw, "Q8_0", np.array([0], np.int32), 33)


# ---- the ops of gpt-oss, deepseek2 and glm4moe ----------------------------------------------

def yarn_ref(x, pos, n_rot, base, freq_scale, neox, ext_factor, attn_factor, beta_fast, beta_slow, n_ctx_orig):
    """ggml's rope_yarn in float64: interpolated and extrapolated angles blended over the
    corrected dims, cos/sin scaled by attn_factor * (1 + 0.1 ln(1/freq_scale))."""
    def corr(n_turns):
        return n_rot * np.log(n_ctx_orig / (n_turns * 2 * np.pi)) / (2 * np.log(base))
    lo, hi = max(0.0, np.floor(corr(beta_fast))), min(n_rot - 1.0, np.ceil(corr(beta_slow)))
    half = n_rot // 2
    i = np.arange(half)
    extrap = pos[:, None].astype(np.float64) * base ** (-2.0 * i / n_rot)
    ramp = (1 - np.clip((i - lo) / max(0.001, hi - lo), 0, 1)) * ext_factor
    theta = extrap * freq_scale * (1 - ramp) + extrap * ramp
    m = attn_factor * (1 + 0.1 * np.log(1 / freq_scale)) if ext_factor else attn_factor
    c, s = (np.cos(theta) * m)[:, None, :], (np.sin(theta) * m)[:, None, :]
    y = x.astype(np.float64).copy()
    a, b = (slice(0, half), slice(half, n_rot)) if neox else (slice(0, n_rot, 2), slice(1, n_rot, 2))
    x0, x1 = y[..., a].copy(), y[..., b].copy()
    y[..., a] = x0 * c - x1 * s
    y[..., b] = x0 * s + x1 * c
    return y


@pytest.mark.parametrize("neox,hd,n_rot,base,factor,attn,n_ctx_orig", [
    (True, 64, 64, 150000.0, 32.0, 1.0, 4096),    # gpt-oss
    (False, 32, 32, 10000.0, 40.0, 0.7305, 4096),  # deepseek2's rope dims
    (True, 128, 64, 1e6, 4.0, 1.2, 8192),
])
def test_rope_yarn(isa, neox, hd, n_rot, base, factor, attn, n_ctx_orig):
    r = rng(n_rot)
    x = r.standard_normal((6, 3, hd)).astype(np.float32)
    pos = np.array([0, 1, 17, 500, 2100, 4095], np.int32)  # float angles lose ~6e-8 x pos
    got = ops.rope(x, pos, n_rot, base, 1 / factor, neox, ext_factor=1.0, attn_factor=attn, n_ctx_orig=n_ctx_orig)
    ref = yarn_ref(x, pos, n_rot, base, 1 / factor, neox, 1.0, attn, 32.0, 1.0, n_ctx_orig)
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4)
    # ext_factor 0 and attn_factor 1 is plain RoPE with the same scale
    plain = ops.rope(x, pos, n_rot, base, 1 / factor, neox, ext_factor=0.0, attn_factor=1.0)
    np.testing.assert_allclose(plain, rope_ref(x, pos, n_rot, base, 1 / factor, neox), rtol=2e-4, atol=2e-4)


def sink_attn_ref(q, k, v, q_pos, kv_pos, scale, window, sinks):
    """Causal attention whose softmax denominator also holds exp(sink) per head (gpt-oss)."""
    n_tok, n_head, _ = q.shape
    k64, v64 = kv_values(k, "F16"), kv_values(v, "F16")
    n_rep = n_head // k.shape[1]
    qp, kp = q_pos[:, None].astype(np.int64), kv_pos[None, :].astype(np.int64)
    vis = (kp >= 0) & (kp <= qp)
    if window:
        vis &= (qp - kp) < window
    out = np.zeros((n_tok, n_head, v.shape[2]))
    for h in range(n_head):
        s = np.where(vis, q[:, h, :].astype(np.float64) @ k64[:, h // n_rep, :].T * scale, -np.inf)
        m = np.maximum(s.max(axis=1, keepdims=True), sinks[h])
        p = np.exp(s - m)
        out[:, h, :] = (p @ v64[:, h // n_rep, :]) / (p.sum(axis=1, keepdims=True) + np.exp(sinks[h] - m))
    return out


@pytest.mark.parametrize("n_tok,n_kv,window", [(1, 300, 0), (5, 40, 8), (40, 40, 8), (64, 64, 0)])
def test_attn_sinks_and_a_v_narrower_than_k(isa, n_tok, n_kv, window):
    """Sinks (gpt-oss) and a value head narrower than the key head (deepseek2's absorbed MLA:
    keys of 160, values of 128), on the one-token, few-token and prompt paths."""
    r = rng(n_tok + n_kv)
    for hd_k, hd_v, n_head, n_head_kv in [(64, 64, 8, 2), (160, 128, 8, 1)]:
        q = r.standard_normal((n_tok, n_head, hd_k)).astype(np.float32)
        k = r.standard_normal((n_kv, n_head_kv, hd_k)).astype(np.float32)
        v = r.standard_normal((n_kv, n_head_kv, hd_v)).astype(np.float32)
        kv_pos = np.arange(n_kv, dtype=np.int32)
        q_pos = np.arange(n_kv - n_tok, n_kv, dtype=np.int32)
        sinks = (r.standard_normal(n_head) * 2).astype(np.float32)
        scale = 1 / np.sqrt(hd_k)
        got = ops.flash_attn(q, k, v, q_pos, kv_pos, scale, window=window, sinks=sinks)
        np.testing.assert_allclose(got, sink_attn_ref(q, k, v, q_pos, kv_pos, scale, window, sinks), rtol=2e-3,
                                   atol=2e-3)
        plain = ops.flash_attn(q, k, v, q_pos, kv_pos, scale, window=window)
        np.testing.assert_allclose(plain, sink_attn_ref(q, k, v, q_pos, kv_pos, scale, window, np.full(n_head, -np.inf)),
                                   rtol=2e-3, atol=2e-3)


def select_ref(x, k, gating, bias, n_groups, n_group_used):
    """Expert selection as llama.cpp's build_moe_ffn does it: score = gate(x) + bias; groups
    ranked by the sum of their two best scores; top-k among the kept groups (ties: lower id)."""
    score = 1 / (1 + np.exp(-x.astype(np.float64))) if gating == 1 else x.astype(np.float64)
    if bias is not None:
        score = score + bias
    ids = []
    for row in score:
        row = row.copy()
        if n_groups > 1:
            g = row.reshape(n_groups, -1)
            gs = np.sort(g, axis=1)[:, -2:].sum(axis=1)
            keep = sorted(range(n_groups), key=lambda i: (-gs[i], i))[:n_group_used]
            mask = np.full(n_groups, True)
            mask[keep] = False
            g[mask] = -np.inf
            row = g.reshape(-1)
        ids.append(sorted(range(len(row)), key=lambda e: (-row[e], e))[:k])
    return np.array(ids)


@pytest.mark.parametrize("gating,use_bias,groups", [(0, False, (0, 0)), (1, True, (0, 0)), (1, True, (4, 3)),
                                                    (2, False, (0, 0)), (0, True, (4, 2))])
def test_expert_selection(gating, use_bias, groups):
    r = rng(gating * 7 + groups[0])
    x = (r.standard_normal((50, 16)) * 3).astype(np.float32)
    bias = (r.standard_normal(16) * 0.5).astype(np.float32) if use_bias else None
    got = ops.top_k(x, 6, gating, bias, *groups)
    np.testing.assert_array_equal(got, select_ref(x, 6, gating, bias, *groups))


def test_moe_weights_softmax_over_the_picked_and_add_id():
    r = rng(3)
    logits = r.standard_normal((9, 32)).astype(np.float32) * 2
    ids = np.argsort(-logits, axis=1)[:, :4].astype(np.int32)
    w = ops.moe_weights(logits, ids, 2, False, 0.0)
    picked = np.take_along_axis(logits.astype(np.float64), ids, 1)
    ref = np.exp(picked - picked.max(1, keepdims=True))
    np.testing.assert_allclose(w, ref / ref.sum(1, keepdims=True), rtol=1e-6)
    x = r.standard_normal((9, 4, 24)).astype(np.float32)
    bias = r.standard_normal((32, 24)).astype(np.float32)
    np.testing.assert_allclose(ops.add_id(x, bias, ids), x + bias[ids], rtol=1e-6)
    with pytest.raises(ValueError, match="expert id 32"):
        ops.add_id(x, bias, np.full_like(ids, 32))


def test_swiglu_oai():
    g = np.linspace(-12, 12, 4001, dtype=np.float32)
    u = np.linspace(9, -9, 4001, dtype=np.float32)
    gc, uc = np.minimum(g, 7.0).astype(np.float64), np.clip(u, -7.0, 7.0).astype(np.float64)
    ref = gc / (1 + np.exp(-1.702 * gc)) * (uc + 1)
    np.testing.assert_allclose(ops.swiglu_oai(g, u), ref, rtol=1e-5, atol=1e-5)


def test_thread_pool_runs_every_part_once_whoever_takes_it():
    """A job's parts go to whichever thread asks first and the job ends when they are done, so
    a worker the OS has not run yet holds nothing up; every part still runs exactly once, and a
    worker that wakes after its job ended does not touch it (each job's data is on the caller's
    stack). 8 threads on this machine's 2 cores oversubscribe it."""
    for threads, jobs, work_us in ((2, 20000, 0), (2, 2000, 20), (8, 2000, 5), (3, 3000, 1)):
        runs, elsewhere, missed = ops.pool_parts(threads, jobs, work_us)
        assert runs == [jobs] * threads and missed == 0, (threads, jobs, runs, missed)
        if work_us >= 20:  # parts long enough for the workers to take some
            assert elsewhere > 0
