"""The ops on every device: each test runs on the CPU and on each CUDA device against a numpy
float64 (or gguf-package) oracle. CUDA cases are skipped, with the reason, where stowlm was
built without CUDA or no device is present; STOWLM_REQUIRE_GPU=1 turns that skip into a
failure (for GPU CI)."""
import numpy as np
import pytest

from conftest import require_devices
from stowlm import _core
from test_matmul import set_scales

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize  # noqa: E402
from test_ops import select_ref, sink_attn_ref, yarn_ref  # noqa: E402  (the CPU op tests' numpy oracles)

T = gguf.GGMLQuantizationType
DEVICES = ["cpu", "cuda:0"]


@pytest.fixture(params=DEVICES)
def dev(request):
    require_devices(request.param)
    return request.param


def cuda_only(dev):
    if dev == "cpu":
        pytest.skip("CUDA-only op")


def run(dev, op, *args, **kw):
    if dev == "cpu":
        return getattr(_core.ops, op)(*args, **kw)
    return getattr(_core.cuda_ops, op)(*args, **kw, device=int(dev.split(":")[1]))


# ---- matmul -------------------------------------------------------------------------------

QTYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q8_K",
          "MXFP4", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"]


def random_weights(name, rows, cols, rng):
    if name in ("F32", "F16", "BF16"):
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        if name == "F16":
            w16 = w.astype(np.float16)
            return w16.view(np.uint8), w16.astype(np.float64)
        if name == "BF16":
            bits = (w.view(np.uint32) >> 16).astype(np.uint16)
            return bits.view(np.uint8), (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return w.view(np.uint8), w.astype(np.float64)
    belems, bbytes = gguf.GGML_QUANT_SIZES[T[name]]
    nb = rows * cols // belems
    blocks = rng.integers(0, 256, size=(nb, bbytes), dtype=np.uint8)
    if name == "Q8_K":
        blocks[:, 0:4] = rng.uniform(0.001, 0.02, nb).astype(np.float32).view(np.uint8).reshape(nb, 4)
        d = blocks[:, 0:4].copy().view(np.float32).astype(np.float64)
        return blocks.reshape(rows, -1), (d * blocks[:, 4:260].view(np.int8)).reshape(rows, cols)
    set_scales(blocks, name, rng)
    raw = blocks.reshape(rows, -1)
    return raw, dequantize(raw, T[name]).astype(np.float64).reshape(rows, cols)


def check_matmul(y, w, x, quantized):
    ref = x.astype(np.float64) @ w.T
    # 8-bit activations: error bounded by half a step (max|x|/254 per 32-block) per element.
    tol = (np.abs(w).sum(axis=1)[None, :] * np.abs(x).max() / 254 * 1.05 + 1e-4) if quantized else \
        (1e-5 * np.abs(w) @ np.abs(x.astype(np.float64)).T).T + 1e-5
    assert y.shape == ref.shape
    assert np.all(np.abs(y - ref) <= tol), f"max err {np.abs(y - ref).max()}"


@pytest.mark.parametrize("name", QTYPES + ["F32", "F16", "BF16"])
@pytest.mark.parametrize("rows,cols,n_tok", [(7, 256, 1), (67, 512, 8), (130, 512, 45)])
def test_matmul(dev, name, rows, cols, n_tok):
    rng = np.random.default_rng(rows + n_tok)
    raw, w = random_weights(name, rows, cols, rng)
    x = rng.standard_normal((n_tok, cols)).astype(np.float32)
    y = run(dev, "matmul_raw", raw, int(T[name]), rows, cols, x)
    check_matmul(y, w, x, name not in ("F32", "F16", "BF16"))


def vector_and_tiled(dev, name, rows, cols, n_tok, seed, rtol):
    """Random weights and activations through the vector and the tiled kernel, which must agree
    within rtol: (raw, w, x, y_vector, y_tiled)."""
    rng = np.random.default_rng(seed)
    raw, w = random_weights(name, rows, cols, rng)
    x = rng.standard_normal((n_tok, cols)).astype(np.float32)
    yv = run(dev, "matmul_raw", raw, int(T[name]), rows, cols, x, path="vector")
    yt = run(dev, "matmul_raw", raw, int(T[name]), rows, cols, x, path="tiled")
    np.testing.assert_allclose(yt, yv, rtol=rtol, atol=rtol * np.abs(yv).max())
    return raw, w, x, yv, yt


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "Q5_0", "Q3_K", "IQ4_XS", "MXFP4", "IQ2_XXS",
                                  "IQ2_S", "IQ3_S", "IQ1_M"])
def test_matmul_vector_and_tiled_paths_agree(dev, name):
    """The same quantized activations through mmvq (dp4a) and mmq (int8 tensor cores)."""
    cuda_only(dev)
    raw, w, x, yv, yt = vector_and_tiled(dev, name, 96, 768, 40, 7, 1e-4)
    check_matmul(yt, w, x, True)


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_float_tiled_product_is_each_rows_own(dev, name):
    """Float weights (a MoE router, an F16 model) through the tiled kernel (prompts): the
    product's value within float rounding of the vector kernel's, and each activation row's
    result the same bits whatever else is in the batch (130 rows: tile edges in both directions;
    a column count not a multiple of the 32-column tile)."""
    cuda_only(dev)
    raw, w, x, yv, yt = vector_and_tiled(dev, name, 130, 200, 130, 17, 1e-5)
    check_matmul(yt, w, x, False)
    part = run(dev, "matmul_raw", raw, int(T[name]), 130, 200, x[70:83], path="tiled")
    np.testing.assert_array_equal(part, yt[70:83])


@pytest.mark.parametrize("path,n_tok", [("vector", 3), ("tiled", 40)])
def test_matmul_reusing_the_quantized_activations(dev, path, n_tok):
    """The second product of the same x with x_quantized (the scratch holds the rows the first
    quantized, as the q, k and v products of one input do) gives the bits of its own product."""
    cuda_only(dev)
    rng = np.random.default_rng(9)
    raw1, _ = random_weights("Q4_K", 64, 512, rng)
    raw2, _ = random_weights("Q4_K", 64, 512, rng)
    x = rng.standard_normal((n_tok, 512)).astype(np.float32)
    y1, y2 = run(dev, "matmul_reusing", raw1, raw2, int(T["Q4_K"]), 64, 512, x, path=path)
    np.testing.assert_array_equal(y1, run(dev, "matmul_raw", raw1, int(T["Q4_K"]), 64, 512, x, path=path))
    np.testing.assert_array_equal(y2, run(dev, "matmul_raw", raw2, int(T["Q4_K"]), 64, 512, x, path=path))


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "Q6_K", "Q5_0", "IQ4_XS"])
@pytest.mark.parametrize("n_tok", [1, 3, 8])
@pytest.mark.parametrize("gelu", [False, True])
def test_matmul_glu_gives_the_bits_of_its_three_kernels(dev, name, n_tok, gelu):
    """Gate and up products and their GLU in one kernel (a decode step's FFN) against the two
    vector products and the swiglu / geglu kernel launched apart, bit for bit."""
    cuda_only(dev)
    rng = np.random.default_rng(13 + n_tok)
    rawg, _ = random_weights(name, 136, 512, rng)
    rawu, _ = random_weights(name, 136, 512, rng)
    x = rng.standard_normal((n_tok, 512)).astype(np.float32)
    g, u, act = run(dev, "matmul_glu", rawg, rawu, int(T[name]), 136, 512, x, gelu=gelu)
    np.testing.assert_array_equal(g, run(dev, "matmul_raw", rawg, int(T[name]), 136, 512, x, path="vector"))
    np.testing.assert_array_equal(u, run(dev, "matmul_raw", rawu, int(T[name]), 136, 512, x, path="vector"))
    np.testing.assert_array_equal(act, run(dev, "geglu" if gelu else "swiglu", g, u))


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q5_0", "Q6_K"])
@pytest.mark.parametrize("n_tok", [1, 3, 8])
@pytest.mark.parametrize("rows", [(576, 192, 192), (136, 8), (5,)])
def test_matmul_multi_gives_each_products_bits(dev, name, n_tok, rows):
    """A layer's q, k and v products of one x in one launch (matmul_multi) against each product
    launched by itself, bit for bit; row counts that leave a block part full included."""
    cuda_only(dev)
    rng = np.random.default_rng(31 + n_tok + len(rows))
    raws = [random_weights(name, r, 512, rng)[0] for r in rows]
    x = rng.standard_normal((n_tok, 512)).astype(np.float32)
    ys = run(dev, "matmul_multi", raws, int(T[name]), list(rows), 512, x)
    assert len(ys) == len(rows)
    for raw, r, y in zip(raws, rows, ys):
        np.testing.assert_array_equal(y, run(dev, "matmul_raw", raw, int(T[name]), r, 512, x, path="vector"))


def test_device_quantizer_bit_exact_with_host(dev):
    cuda_only(dev)
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((5, 256)) * 3).astype(np.float32)
    x[0, :32] = 0
    dev_bytes = run(dev, "quantize_q8_1", x)
    qs, d, s = _core.cuda_math.quantize_q8_1(x)
    blocks = dev_bytes.reshape(5, 8, 48)
    np.testing.assert_array_equal(blocks[:, :, :32].view(np.int8).reshape(5, 256), qs)
    tail = blocks[:, :, 32:].copy().view(np.float32).reshape(5, 8, 4)
    np.testing.assert_array_equal(tail[..., 0], d)
    np.testing.assert_array_equal(tail[..., 1:3], s)


# ---- attention ------------------------------------------------------------------------------

def attn_reference(q, k, v, q_pos, kv_pos, scale, softcap, window, causal):
    n_tok, n_head, hd = q.shape
    n_head_kv = k.shape[1]
    out = np.zeros((n_tok, n_head, hd))
    k64, v64 = k.astype(np.float64), v.astype(np.float64)
    for t in range(n_tok):
        vis = (kv_pos != -1)
        if causal:
            vis &= kv_pos <= q_pos[t]
        if window:
            vis &= (q_pos[t] - kv_pos) < window
        if not vis.any():
            continue
        for h in range(n_head):
            kh = h // (n_head // n_head_kv)
            s = k64[vis, kh] @ q[t, h].astype(np.float64) * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            p = np.exp(s - s.max())
            out[t, h] = p @ v64[vis, kh] / p.sum()
    return out


ATTN_CASES = [
    (1, 8, 2, 64, 700, 0.0, 0, 1),
    (1, 8, 2, 64, 700, 0.0, 0, 5),     # split-KV decode
    (5, 4, 4, 80, 37, 30.0, 0, 1),      # head_dim not a multiple of 32, softcap
    (6, 4, 1, 128, 50, 0.0, 8, 3),      # sliding window, MQA, splits
    (3, 2, 2, 256, 20, 0.0, 0, 1),
]


def attn_inputs(n_tok, n_head, n_head_kv, hd, n_kv):
    rng = np.random.default_rng(n_kv + hd)
    q = rng.standard_normal((n_tok, n_head, hd)).astype(np.float32)
    k = rng.standard_normal((n_kv, n_head_kv, hd)).astype(np.float32)
    v = rng.standard_normal((n_kv, n_head_kv, hd)).astype(np.float32)
    kv_pos = np.arange(n_kv, dtype=np.int32)
    kv_pos[rng.integers(0, n_kv, max(1, n_kv // 10))] = -1  # empty cells
    q_pos = np.arange(n_kv - n_tok, n_kv, dtype=np.int32)
    if n_tok > 1:
        q_pos[0] = -5  # a query that sees nothing gets zeros
    return q, k, v, q_pos, kv_pos


@pytest.mark.parametrize("n_tok,n_head,n_head_kv,hd,n_kv,softcap,window,n_split", ATTN_CASES)
def test_flash_attn(dev, n_tok, n_head, n_head_kv, hd, n_kv, softcap, window, n_split):
    q, k, v, q_pos, kv_pos = attn_inputs(n_tok, n_head, n_head_kv, hd, n_kv)
    k, v = k.astype(np.float16), v.astype(np.float16)
    scale = 1 / np.sqrt(hd)
    ref = attn_reference(q, k, v, q_pos, kv_pos, scale, softcap, window, True)
    if dev == "cpu":
        out = run(dev, "flash_attn", q, k, v, q_pos, kv_pos, scale, softcap=softcap, window=window)
    else:
        out = run(dev, "flash_attn", q, k.view(np.uint16), v.view(np.uint16), q_pos, kv_pos, scale,
                  softcap=softcap, window=window, n_split=n_split)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("n_split", [1, 4])
def test_flash_attn_q8_0_cache(dev, n_split):
    """float32 K/V stored into Q8_0 cells by the device's own store_kv, then attended; the oracle
    attends over the gguf package's Q8_0 round trip of the same values."""
    n_tok, n_head, n_head_kv, hd, n_kv = 3, 4, 2, 64, 300
    q, k, v, q_pos, kv_pos = attn_inputs(n_tok, n_head, n_head_kv, hd, n_kv)
    rt = lambda a: dequantize(gguf.quants.quantize(a.reshape(-1, hd), T.Q8_0), T.Q8_0).reshape(a.shape)
    scale = 1 / np.sqrt(hd)
    ref = attn_reference(q, rt(k), rt(v), q_pos, kv_pos, scale, 0.0, 0, True)
    kw = {"kv_type": "Q8_0"} if dev == "cpu" else {"kv_type": "Q8_0", "n_split": n_split}
    out = run(dev, "flash_attn", q, k, v, q_pos, kv_pos, scale, **kw)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("n_tok,hd,n_split", [(1, 64, 1), (1, 64, 4), (3, 128, 1), (12, 64, 1), (2, 64, 0)])
def test_flash_attn_writes_its_outputs_q8_1_rows(dev, n_tok, hd, n_split):
    """The attention kernel that also writes its output's block_q8_1 rows (for attn_output's
    product): the same output, and rows that are the device quantizer's of it, byte for byte,
    through one block, split partials and their merge, and a prompt-sized pass."""
    cuda_only(dev)
    q, k, v, q_pos, kv_pos = attn_inputs(n_tok, 6, 2, hd, 700)
    k, v = k.astype(np.float16).view(np.uint16), v.astype(np.float16).view(np.uint16)
    scale = 1 / np.sqrt(hd)
    plain = run(dev, "flash_attn", q, k, v, q_pos, kv_pos, scale, n_split=n_split)
    out, rows = run(dev, "flash_attn", q, k, v, q_pos, kv_pos, scale, n_split=n_split, q8_1=True)
    np.testing.assert_array_equal(out, plain)
    np.testing.assert_array_equal(rows, run(dev, "quantize_q8_1", out.reshape(n_tok, -1)))


# ---- elementwise --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["F32", "F16", "BF16", "Q4_0", "Q5_1", "Q8_0", "IQ4_NL", "Q2_K", "Q3_K",
                                  "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "MXFP4", "IQ2_XXS", "IQ2_XS", "IQ2_S",
                                  "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"])
def test_get_rows(dev, name):
    rng = np.random.default_rng(9)
    raw, w = random_weights(name, 20, 512, rng)
    ids = np.array([3, 0, 19, 3, 7], np.int32)
    out = run(dev, "get_rows", raw, int(T[name]), ids, 512)
    np.testing.assert_array_equal(out, w[ids].astype(np.float32))


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4", "Q2_K", "Q3_K", "Q4_K",
                                  "Q5_K", "Q6_K", "IQ4_XS"])
@pytest.mark.parametrize("rows", [48, 37])  # whole groups, and a tail of 5 rows after two
def test_unrepack_rows16_gives_the_gguf_bytes_back(dev, name, rows):
    """A staged copy of experts the CPU keeps repacked goes back to the file's bytes on the GPU."""
    cuda_only(dev)
    rng = np.random.default_rng(rows)
    n_mat, cols = 3, 512
    raws = [random_weights(name, rows, cols, rng)[0] for _ in range(n_mat)]
    packed = np.concatenate([_core.ops.repack_rows16_raw(r.reshape(-1), int(T[name]), rows, cols) for r in raws])
    gguf_bytes = np.concatenate([r.reshape(-1) for r in raws])
    assert not np.array_equal(packed, gguf_bytes)
    out = run(dev, "unrepack_rows16", packed, int(T[name]), n_mat, rows, cols)
    np.testing.assert_array_equal(out, gguf_bytes)


def test_get_rows_rejects_bad_id(dev):
    raw = np.zeros((4, 32 * 4), np.uint8)
    with pytest.raises(ValueError, match="outside"):
        run(dev, "get_rows", raw, int(T.F32), np.array([4], np.int32), 32)


def test_rms_norm(dev):
    rng = np.random.default_rng(10)
    x = rng.standard_normal((7, 896)).astype(np.float32)
    w = rng.standard_normal(896).astype(np.float32)
    y = run(dev, "rms_norm", x, w, 1e-6)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("y_in_a", [False, True])
def test_add_rms_norm_gives_the_bits_of_add_then_rms_norm(dev, y_in_a):
    """The fused residual add and norm (a decode step's add_rms_norm) against the two kernels it
    replaces, bit for bit, also when its output takes the bytes of an input (as the planner may)."""
    cuda_only(dev)
    rng = np.random.default_rng(12)
    a, b = (rng.standard_normal((5, 896)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal(896).astype(np.float32)
    s, y, q = run(dev, "add_rms_norm", a, b, w, 1e-6, y_in_a=y_in_a, quantized=True)
    np.testing.assert_array_equal(s, run(dev, "add", a, b))
    np.testing.assert_array_equal(y, run(dev, "rms_norm", s, w, 1e-6))
    # the q8_1 rows it writes for the products that read y: the quantizer's bytes
    np.testing.assert_array_equal(q, run(dev, "quantize_q8_1", y))
    none, y1, q1 = run(dev, "add_rms_norm", a, None, w, 1e-6, quantized=True)  # no add: the norm alone
    assert none is None
    np.testing.assert_array_equal(y1, run(dev, "rms_norm", a, w, 1e-6))
    np.testing.assert_array_equal(q1, run(dev, "quantize_q8_1", y1))


@pytest.mark.parametrize("neox", [False, True])
def test_rope(dev, neox):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((5, 3, 64)).astype(np.float32)
    pos = np.array([0, 1, 7, 300, 4095], np.int32)
    n_rot = 48
    y = run(dev, "rope", x, pos, n_rot, 10000.0, 0.5, neox)
    half = n_rot // 2
    th = pos[:, None] * 0.5 * 10000.0 ** (-2.0 * np.arange(half) / n_rot)
    c, s = np.cos(th)[:, None, :], np.sin(th)[:, None, :]
    ref = x.astype(np.float64).copy()
    i0 = np.arange(half) if neox else 2 * np.arange(half)
    i1 = i0 + half if neox else i0 + 1
    x0, x1 = x[..., i0].astype(np.float64), x[..., i1].astype(np.float64)
    ref[..., i0] = x0 * c - x1 * s
    ref[..., i1] = x0 * s + x1 * c
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("neox", [False, True])
def test_rope_pair_rotates_as_two_ropes(dev, neox):
    """q (6 heads) and k (2 heads) rotated in one launch: the bits of rope on each."""
    cuda_only(dev)
    rng = np.random.default_rng(17)
    q = rng.standard_normal((4, 6, 64)).astype(np.float32)
    k = rng.standard_normal((4, 2, 64)).astype(np.float32)
    pos = np.array([0, 5, 300, 4095], np.int32)
    qr, kr = run(dev, "rope_pair", q, k, pos, 48, 10000.0, 0.5, neox)
    np.testing.assert_array_equal(qr, run(dev, "rope", q, pos, 48, 10000.0, 0.5, neox))
    np.testing.assert_array_equal(kr, run(dev, "rope", k, pos, 48, 10000.0, 0.5, neox))


@pytest.mark.parametrize("op", ["add", "mul", "swiglu", "geglu"])
@pytest.mark.parametrize("bcast", [False, True])
def test_binary(dev, op, bcast):
    rng = np.random.default_rng(12)
    a = rng.standard_normal((4, 300)).astype(np.float32)
    b = rng.standard_normal(300 if bcast else (4, 300)).astype(np.float32)
    if bcast and op in ("swiglu", "geglu"):
        pytest.skip("gated activations take full rows")
    y = run(dev, op, a, b)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    ref = {"add": a64 + b64, "mul": a64 * b64, "swiglu": a64 / (1 + np.exp(-a64)) * b64,
           "geglu": 0.5 * a64 * (1 + np.tanh(0.7978845608028654 * (a64 + 0.044715 * a64 ** 3))) * b64}[op]
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)


def test_scale_and_softcap(dev):
    x = np.linspace(-100, 100, 512, dtype=np.float32).reshape(2, 256)
    np.testing.assert_allclose(run(dev, "scale", x, 0.25), x * 0.25, rtol=1e-7)
    np.testing.assert_allclose(run(dev, "softcap", x, 30.0), 30 * np.tanh(x.astype(np.float64) / 30), rtol=1e-5, atol=1e-5)


def test_softmax(dev):
    cuda_only(dev)
    rng = np.random.default_rng(13)
    x = (rng.standard_normal((3, 1000)) * 20).astype(np.float32)
    y = run(dev, "softmax", x, 0.5)
    e = np.exp(x * 0.5 - (x * 0.5).max(axis=1, keepdims=True))
    np.testing.assert_allclose(y, e / e.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-8)


def test_f16_conversions_bit_exact(dev):
    cuda_only(dev)
    rng = np.random.default_rng(14)
    x = np.concatenate([rng.standard_normal(1000) * 1000, [0.0, -0.0, 65504, 65520, 1e-8, np.inf, -np.inf]]).astype(np.float32)
    np.testing.assert_array_equal(run(dev, "f32_to_f16", x), x.astype(np.float16).view(np.uint16))
    h = rng.integers(0, 0x7c00, 1000).astype(np.uint16)
    np.testing.assert_array_equal(run(dev, "f16_to_f32", h), h.view(np.float16).astype(np.float32))


@pytest.mark.parametrize("kv_type", ["F16", "Q8_0"])
def test_store_kv_matches_cpu_cache_bytes(dev, kv_type):
    rng = np.random.default_rng(15)
    x = rng.standard_normal((3, 2, 64)).astype(np.float32)
    row = 64 * 2 if kv_type == "F16" else 2 * 34
    cache = np.zeros((10, 2 * row), np.uint8)
    cells = np.array([4, 0, 9], np.int32)
    run(dev, "store_kv", x, kv_type, cache, cells)
    if kv_type == "F16":
        want = x.astype(np.float16).view(np.uint8).reshape(3, -1)
    else:
        want = gguf.quants.quantize(x.reshape(-1, 64), T.Q8_0).reshape(3, -1)
    np.testing.assert_array_equal(cache[cells], want)
    assert not cache[[1, 2, 3, 5, 6, 7, 8]].any()


@pytest.mark.parametrize("kv_type", ["F16", "Q8_0"])
def test_store_kv_pair_writes_what_two_stores_write(dev, kv_type):
    """A layer's K and V stored in one launch (K 2 heads of 64, V 2 heads of 32): each cache gets
    the bytes its own store gives."""
    cuda_only(dev)
    rng = np.random.default_rng(16)
    k = rng.standard_normal((3, 2, 64)).astype(np.float32)
    v = rng.standard_normal((3, 2, 32)).astype(np.float32)
    cells = np.array([4, 0, 9], np.int32)
    kb, vb = (64 * 2, 32 * 2) if kv_type == "F16" else (2 * 34, 34)
    caches = [np.zeros((10, 2 * kb), np.uint8), np.zeros((10, 2 * vb), np.uint8)]
    run(dev, "store_kv_pair", k, v, kv_type, caches[0], caches[1], cells)
    for x, c, b in ((k, caches[0], kb), (v, caches[1], vb)):
        want = np.zeros((10, 2 * b), np.uint8)
        run(dev, "store_kv", x, kv_type, want, cells)
        np.testing.assert_array_equal(c, want)


@pytest.mark.parametrize("kv_type", ["F16", "Q8_0"])
@pytest.mark.parametrize("neox", [False, True])
def test_rope_store_gives_the_bits_of_rope_pair_then_store_kv_pair(dev, kv_type, neox):
    """A layer's q and k rotated and its K and V stored in one launch (q 6 heads, k 2 of 64, v 2 of
    32; a token whose cell is -1 is rotated, not stored): the bits of the two launches."""
    cuda_only(dev)
    rng = np.random.default_rng(18)
    q = rng.standard_normal((4, 6, 64)).astype(np.float32)
    k = rng.standard_normal((4, 2, 64)).astype(np.float32)
    v = rng.standard_normal((4, 2, 32)).astype(np.float32)
    pos = np.array([0, 5, 300, 4095], np.int32)
    cells = np.array([4, -1, 9, 0], np.int32)
    kb, vb = (64 * 2, 32 * 2) if kv_type == "F16" else (2 * 34, 34)
    got = [np.zeros((10, 2 * kb), np.uint8), np.zeros((10, 2 * vb), np.uint8)]
    qr, kr = run(dev, "rope_store", q, k, v, pos, 48, 10000.0, 0.5, neox, kv_type, got[0], got[1], cells)
    want_q, want_k = run(dev, "rope_pair", q, k, pos, 48, 10000.0, 0.5, neox)
    want = [np.zeros_like(got[0]), np.zeros_like(got[1])]
    run(dev, "store_kv_pair", want_k, v, kv_type, want[0], want[1], cells)
    np.testing.assert_array_equal(qr, want_q)
    np.testing.assert_array_equal(kr, want_k)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


# ---- mixture of experts --------------------------------------------------------------------

def test_router_topk_matches_host(dev):
    cuda_only(dev)
    rng = np.random.default_rng(16)
    logits = rng.standard_normal((33, 60)).astype(np.float32)
    logits[:, 5] = logits[:, 9]  # ties
    ids, w = run(dev, "router_topk", logits, 4, True, True)
    for t in range(33):
        hid, hw = _core.cuda_math.router_topk(logits[t], 4, True, True)
        np.testing.assert_array_equal(ids[t], hid)
        np.testing.assert_allclose(w[t], hw, rtol=1e-6)


@pytest.mark.parametrize("sigmoid,normalize,scale", [(False, True, 0.0), (True, False, 2.5)])
def test_top_k_moe_weights_match_host(dev, sigmoid, normalize, scale):
    """The engine's TOP_K and MOE_WEIGHTS kernels against the same HOST_DEVICE functions on the CPU."""
    cuda_only(dev)
    rng = np.random.default_rng(18)
    logits = (2 * rng.standard_normal((300, 64))).astype(np.float32)
    logits[:, 7] = logits[:, 3]  # ties: lower index first
    ids, w = run(dev, "top_k_moe_weights", logits, 6, sigmoid, normalize, scale)
    hid, hw = _core.cuda_math.top_k_moe_weights(logits, 6, sigmoid, normalize, scale)
    np.testing.assert_array_equal(ids, hid)
    np.testing.assert_allclose(w, hw, rtol=1e-5)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K", "Q6_K", "F16", "MXFP4", "IQ2_XXS"])
@pytest.mark.parametrize("per_slot_input", [False, True])
def test_moe_matmul(dev, name, per_slot_input):
    cuda_only(dev)
    rng = np.random.default_rng(17)
    n_expert, rows, cols, n_tok, k = 6, 40, 256, 21, 2
    raws, ws = zip(*[random_weights(name, rows, cols, rng) for _ in range(n_expert)])
    raw = np.concatenate([r.reshape(-1) for r in raws])
    ids = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(n_tok)]).astype(np.int32)
    ids[:, 0] = np.minimum(ids[:, 0], 4)  # expert 5 gets few tokens, maybe none
    n_act = n_tok * k if per_slot_input else n_tok
    x = rng.standard_normal((n_act, cols)).astype(np.float32)
    y = run(dev, "moe_matmul", raw, int(T[name]), n_expert, rows, cols, x, ids, per_slot_input)
    for t in range(n_tok):
        for j in range(k):
            xr = x[t * k + j] if per_slot_input else x[t]
            check_matmul(y[t, j][None], ws[ids[t, j]], xr[None], name != "F16")


@pytest.mark.parametrize("name", ["Q4_K", "F16"])
def test_moe_matmul_gives_zero_rows_for_experts_elsewhere(dev, name):
    """Tensor parallelism: a shard holding some of the experts gets id -1 for slots routed to the
    others (LOCAL_IDS), and k may exceed its experts: those rows are zero, the others as before."""
    cuda_only(dev)
    rng = np.random.default_rng(18)
    n_expert, rows, cols, n_tok, k = 3, 40, 256, 70, 4
    raws, ws = zip(*[random_weights(name, rows, cols, rng) for _ in range(n_expert)])
    raw = np.concatenate([r.reshape(-1) for r in raws])
    ids = rng.integers(-1, n_expert, (n_tok, k)).astype(np.int32)
    ids[5] = -1  # a token with none of its experts here
    x = rng.standard_normal((n_tok, cols)).astype(np.float32)
    y = run(dev, "moe_matmul", raw, int(T[name]), n_expert, rows, cols, x, ids, False)
    for t in range(n_tok):
        for j in range(k):
            if ids[t, j] < 0:
                np.testing.assert_array_equal(y[t, j], 0.0)
            else:
                check_matmul(y[t, j][None], ws[ids[t, j]], x[t][None], name != "F16")


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "F16"])
@pytest.mark.parametrize("per_slot_input", [False, True])
def test_moe_matmul_of_one_token_gives_the_grouped_launchs_bits(dev, name, per_slot_input):
    """One token (a decode step) takes the launch by slot, each block reading its expert's id: its
    rows are the bits the grouped launch gives the same token among others, ids -1 (tensor
    parallelism: the expert is on another shard) included."""
    cuda_only(dev)
    rng = np.random.default_rng(19)
    n_expert, rows, cols, n_tok, k = 6, 40, 256, 5, 4
    raws, _ = zip(*[random_weights(name, rows, cols, rng) for _ in range(n_expert)])
    raw = np.concatenate([r.reshape(-1) for r in raws])
    ids = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(n_tok)]).astype(np.int32)
    ids[0, 1] = ids[0, 3] = -1  # routed to another shard: zero rows
    x = rng.standard_normal((n_tok * k if per_slot_input else n_tok, cols)).astype(np.float32)
    grouped = run(dev, "moe_matmul", raw, int(T[name]), n_expert, rows, cols, x, ids, per_slot_input)
    x0 = x[:k] if per_slot_input else x[:1]
    alone = run(dev, "moe_matmul", raw, int(T[name]), n_expert, rows, cols, x0, ids[:1], per_slot_input)
    np.testing.assert_array_equal(alone[0], grouped[0])
    np.testing.assert_array_equal(alone[0, [1, 3]], 0.0)


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "MXFP4"])
@pytest.mark.parametrize("gelu", [False, True])
def test_moe_matmul_glu_gives_the_bits_of_its_three_kernels(dev, name, gelu):
    """One token's gate and up expert products and their GLU in one kernel (a decode step's MoE
    FFN) against the two expert launches and the GLU kernel, bit for bit; a slot routed to another
    shard (-1) gets zero rows as there."""
    cuda_only(dev)
    rng = np.random.default_rng(28)
    n_expert, rows, cols, k = 6, 40, 256, 4
    rawg = np.concatenate([random_weights(name, rows, cols, rng)[0].reshape(-1) for _ in range(n_expert)])
    rawu = np.concatenate([random_weights(name, rows, cols, rng)[0].reshape(-1) for _ in range(n_expert)])
    ids = np.array([[3, -1, 0, 5]], np.int32)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    g, u, act = run(dev, "moe_matmul_glu", rawg, rawu, int(T[name]), n_expert, rows, cols, x, ids, gelu=gelu)
    np.testing.assert_array_equal(g, run(dev, "moe_matmul", rawg, int(T[name]), n_expert, rows, cols, x, ids, False)[0])
    np.testing.assert_array_equal(u, run(dev, "moe_matmul", rawu, int(T[name]), n_expert, rows, cols, x, ids, False)[0])
    np.testing.assert_array_equal(act, run(dev, "geglu" if gelu else "swiglu", g, u))
    assert not g[1].any() and not act[1].any()


def test_local_ids_and_all_reduce_sum_match_the_host(dev):
    """The tensor-parallel kernels run collective_math.h's HOST_DEVICE functions: the same ids, sums
    and gathered rows as the host (which the CPU backend runs), over more elements than one grid pass."""
    cuda_only(dev)
    cm = _core.cuda_math
    rng = np.random.default_rng(19)
    ids = rng.integers(-1, 64, (3000, 8)).astype(np.int32)
    want = cm.local_expert_ids(ids.reshape(-1), 16, 24).reshape(ids.shape)
    np.testing.assert_array_equal(_core.cuda_ops.local_ids(ids, 16, 24), want)
    for n_parts in (0, 1, 2, 3, 16):
        scale = 10.0 ** rng.uniform(-3, 3, (n_parts, 1))
        parts = (rng.standard_normal((n_parts, 1 << 21)) * scale).astype(np.float32)
        got = _core.cuda_ops.all_reduce_sum(parts)
        np.testing.assert_array_equal(got.view(np.uint32), cm.shard_order_sum(parts).view(np.uint32))
    for widths in ([576], [384, 0, 192], [16] * 16):
        cols = 3000
        flat = rng.standard_normal(sum(widths) * cols).astype(np.float32)
        np.testing.assert_array_equal(_core.cuda_ops.all_gather_rows(flat, widths, cols),
                                      cm.gather_rows(flat, widths, cols))


# ---- the ops of gpt-oss, deepseek2 and glm4moe; several sequences ----------------------------

@pytest.mark.parametrize("neox,hd,n_rot,base,factor,attn,n_ctx_orig", [
    (True, 64, 64, 150000.0, 32.0, 1.0, 4096),    # gpt-oss
    (False, 32, 32, 10000.0, 40.0, 0.7305, 4096),  # deepseek2's rope dims
    (True, 128, 64, 1e6, 4.0, 1.2, 8192),
])
def test_rope_yarn(dev, neox, hd, n_rot, base, factor, attn, n_ctx_orig):
    rng = np.random.default_rng(n_rot)
    x = rng.standard_normal((6, 3, hd)).astype(np.float32)
    pos = np.array([0, 1, 17, 500, 2100, 4095], np.int32)
    got = run(dev, "rope", x, pos, n_rot, base, 1 / factor, neox, ext_factor=1.0, attn_factor=attn,
              n_ctx_orig=n_ctx_orig)
    ref = yarn_ref(x, pos, n_rot, base, 1 / factor, neox, 1.0, attn, 32.0, 1.0, n_ctx_orig)
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("n_tok,n_kv,window,n_split", [(1, 300, 0, 1), (1, 700, 0, 4), (5, 40, 8, 1), (40, 64, 0, 2)])
def test_flash_attn_sinks_and_a_v_narrower_than_k(dev, n_tok, n_kv, window, n_split):
    """Sinks (gpt-oss) and a value head narrower than the key head (deepseek2's absorbed MLA: keys
    of 160, values of 128), in one pass and over split KV ranges."""
    rng = np.random.default_rng(n_tok + n_kv)
    for hd_k, hd_v, n_head, n_head_kv in [(64, 64, 8, 2), (160, 128, 8, 1)]:
        q = rng.standard_normal((n_tok, n_head, hd_k)).astype(np.float32)
        k = rng.standard_normal((n_kv, n_head_kv, hd_k)).astype(np.float32)
        v = rng.standard_normal((n_kv, n_head_kv, hd_v)).astype(np.float32)
        kv_pos = np.arange(n_kv, dtype=np.int32)
        q_pos = np.arange(n_kv - n_tok, n_kv, dtype=np.int32)
        sinks = (rng.standard_normal(n_head) * 2).astype(np.float32)
        scale = 1 / np.sqrt(hd_k)
        kw = {} if dev == "cpu" else {"n_split": n_split}
        got = run(dev, "flash_attn", q, k, v, q_pos, kv_pos, scale, window=window, sinks=sinks, **kw)
        np.testing.assert_allclose(got, sink_attn_ref(q, k, v, q_pos, kv_pos, scale, window, sinks), rtol=2e-3,
                                   atol=2e-3)


@pytest.mark.parametrize("hd_k,hd_v,n_split", [(576, 512, 1), (576, 512, 3), (160, 128, 2)])
def test_flash_attn_values_read_from_the_key_cells(dev, hd_k, hd_v, n_split):
    """Multi-head latent attention's cache: V is the first hd_v values of each K cell (a view with
    K's cell stride), up to DeepSeek's 576-wide keys and 512-wide values."""
    cuda_only(dev)
    rng = np.random.default_rng(hd_k + n_split)
    n_tok, n_head, n_kv = 3, 16, 600
    q = rng.standard_normal((n_tok, n_head, hd_k)).astype(np.float32)
    k = rng.standard_normal((n_kv, hd_k)).astype(np.float16)
    kv_pos = np.arange(n_kv, dtype=np.int32)
    kv_pos[[5, 77]] = -1
    q_pos = np.array([10, 400, 599], np.int32)
    scale = 1 / np.sqrt(hd_k)
    got = _core.cuda_ops.flash_attn_v_in_k(q, k.view(np.uint16), hd_v, q_pos, kv_pos, scale, n_split=n_split)
    ref = sink_attn_ref(q, k[:, None, :].astype(np.float32), k[:, None, :hd_v].astype(np.float32), q_pos, kv_pos,
                        scale, 0, np.full(n_head, -np.inf))
    np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-3)


def seq_attn_ref(q, k, v, q_pos, kv_pos, q_seq, kv_seq, scale, sinks):
    """Causal attention in float64 over the cells of each query's own sequence, with sinks."""
    n_tok, n_head, _ = q.shape
    n_rep = n_head // k.shape[1]
    out = np.zeros((n_tok, n_head, v.shape[2]))
    for t in range(n_tok):
        vis = (kv_pos >= 0) & (kv_pos <= q_pos[t]) & (kv_seq == q_seq[t])
        for h in range(n_head):
            sc = k[vis, h // n_rep].astype(np.float64) @ q[t, h].astype(np.float64) * scale
            m = max(sc.max(initial=-np.inf), sinks[h])
            p = np.exp(sc - m)
            out[t, h] = p @ v[vis, h // n_rep].astype(np.float64) / (p.sum() + np.exp(sinks[h] - m))
    return out


@pytest.mark.parametrize("kv_type", ["F16", "Q8_0"])
def test_flash_attn_of_several_sequences_is_batch_independent(dev, kv_type):
    """Four sequences owning 256 cells each, fixed splits of 128: each query sees only its own
    sequence's cells, and its result is the same bits alone or with the others, whether the
    launcher runs the splits in blocks of their own or folds them in one block, and whatever the
    batch spans (the last sequence's region left out of a shorter cell range)."""
    cuda_only(dev)
    rng = np.random.default_rng(24)
    n_seq, seq_cells, split, n_head, n_head_kv, hd = 4, 256, 128, 8, 2, 64
    n_kv = n_seq * seq_cells
    fill = [37, 200, 5, 130]
    kv_seq = np.repeat(np.arange(n_seq, dtype=np.int32), seq_cells)
    kv_pos = np.full(n_kv, -1, np.int32)
    for s_, n in enumerate(fill):
        kv_pos[s_ * seq_cells:s_ * seq_cells + n] = np.arange(n)
    kv_seq[kv_pos < 0] = -1
    k = rng.standard_normal((n_kv, n_head_kv, hd)).astype(np.float32)
    v = rng.standard_normal((n_kv, n_head_kv, hd)).astype(np.float32)
    # values the cells hold exactly
    if kv_type == "Q8_0":
        rt = lambda a: dequantize(gguf.quants.quantize(a.reshape(-1, hd), T.Q8_0), T.Q8_0).reshape(a.shape)
    else:
        rt = lambda a: a.astype(np.float16)
    k, v = rt(k).astype(np.float32), rt(v).astype(np.float32)
    sinks = (rng.standard_normal(n_head) * 2).astype(np.float32)
    q_seq = np.array([3, 0, 1, 2], np.int32)
    q_pos = np.array([fill[s_] - 1 for s_ in q_seq], np.int32)
    q = rng.standard_normal((4, n_head, hd)).astype(np.float32)
    scale = 1 / np.sqrt(hd)
    kw = dict(kv_type=kv_type, sinks=sinks, split_cells=split, seq_cells=seq_cells)

    def attend(idx, n_cells=n_kv, n_split=0):
        return run(dev, "flash_attn", q[idx], k[:n_cells], v[:n_cells], q_pos[idx], kv_pos[:n_cells], scale,
                   q_seq=q_seq[idx], kv_seq=kv_seq[:n_cells], n_split=n_split, **kw)

    together = attend(np.arange(4))
    np.testing.assert_allclose(together, seq_attn_ref(q, k, v, q_pos, kv_pos, q_seq, kv_seq, scale, sinks),
                               rtol=2e-3, atol=2e-3)
    np.testing.assert_array_equal(attend(np.arange(4), n_split=1), together)
    np.testing.assert_array_equal(attend(np.arange(4), n_split=n_kv // split), together)
    for i in range(4):
        np.testing.assert_array_equal(attend(np.array([i]))[0], together[i])
        if q_seq[i] < 3:
            np.testing.assert_array_equal(attend(np.array([i]), n_cells=3 * seq_cells)[0], together[i])


@pytest.mark.parametrize("gating,use_bias,groups", [(0, False, (0, 0)), (1, True, (0, 0)), (1, True, (4, 3)),
                                                    (2, False, (0, 0)), (0, True, (4, 2))])
def test_expert_selection(dev, gating, use_bias, groups):
    rng = np.random.default_rng(gating * 7 + groups[0])
    x = (rng.standard_normal((100, 16)) * 3).astype(np.float32)
    bias = (rng.standard_normal(16) * 0.5).astype(np.float32) if use_bias else None
    got = run(dev, "top_k", x, 6, gating, bias, *groups)
    np.testing.assert_array_equal(got, select_ref(x, 6, gating, bias, *groups))


def test_expert_selection_of_deepseek_v3_shape(dev):
    """256 experts in 8 groups, 4 kept, 8 picked by sigmoid score + bias (DeepSeek-V3, Kimi-K2)."""
    rng = np.random.default_rng(25)
    x = (rng.standard_normal((70, 256)) * 2).astype(np.float32)
    bias = (rng.standard_normal(256) * 0.1).astype(np.float32)
    got = run(dev, "top_k", x, 8, 1, bias, 8, 4)
    np.testing.assert_array_equal(got, select_ref(x, 8, 1, bias, 8, 4))


@pytest.mark.parametrize("gating", [0, 2])
@pytest.mark.parametrize("normalize,scale", [(False, 0.0), (True, 2.5)])
@pytest.mark.parametrize("n_expert,k", [(64, 6), (128, 8), (100, 8)])
def test_top_k_weights_gives_the_two_kernels_bits(dev, gating, normalize, scale, n_expert, k):
    """The router's plain top-k and its picks' weights in one kernel (a decode step's router: a
    warp a row up to 1024 experts) against top_k then moe_weights launched apart, bit for bit, ties
    included (across a warp's lanes and within one lane's elements), and a row with NaN logits."""
    cuda_only(dev)
    rng = np.random.default_rng(27)
    logits = (rng.standard_normal((70, n_expert)) * 2).astype(np.float32)
    logits[:, 9] = logits[:, 2]
    logits[:, 34] = logits[:, 2]  # the same lane as expert 2
    logits[:, n_expert - 1] = logits[:, 0] = logits.max(1)
    logits[5, [3, 40]] = np.nan
    ids, w = run(dev, "top_k_weights", logits, k, gating, normalize, scale)
    want = run(dev, "top_k", logits, k, gating)
    np.testing.assert_array_equal(ids, want)
    np.testing.assert_array_equal(w, run(dev, "moe_weights", logits, want, gating, normalize, scale))


@pytest.mark.parametrize("gating", [0, 1, 2])
@pytest.mark.parametrize("normalize,scale", [(False, 0.0), (True, 2.5)])
def test_moe_weights_every_gating(dev, gating, normalize, scale):
    rng = np.random.default_rng(26)
    logits = (rng.standard_normal((50, 32)) * 2).astype(np.float32)
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :4].astype(np.int32)
    w = run(dev, "moe_weights", logits, ids, gating, normalize, scale)
    l64 = logits.astype(np.float64)
    picked = np.take_along_axis(l64, ids, 1)
    if gating == 0:
        e = np.exp(l64 - l64.max(1, keepdims=True))
        ref = np.take_along_axis(e / e.sum(1, keepdims=True), ids, 1)
    elif gating == 1:
        ref = 1 / (1 + np.exp(-picked))
    else:
        e = np.exp(picked - picked.max(1, keepdims=True))
        ref = e / e.sum(1, keepdims=True)
    if normalize:
        ref = ref / np.maximum(ref.sum(1, keepdims=True), 2.0**-14)
    if scale not in (0.0, 1.0):
        ref = ref * scale
    np.testing.assert_allclose(w, ref, rtol=2e-5)


def test_add_id_and_swiglu_oai(dev):
    rng = np.random.default_rng(27)
    x = rng.standard_normal((9, 4, 24)).astype(np.float32)
    bias = rng.standard_normal((32, 24)).astype(np.float32)
    ids = rng.integers(0, 32, (9, 4)).astype(np.int32)
    np.testing.assert_allclose(run(dev, "add_id", x, bias, ids), x + bias[ids], rtol=1e-6)
    g = np.linspace(-12, 12, 4001, dtype=np.float32)
    u = np.linspace(9, -9, 4001, dtype=np.float32)
    gc, uc = np.minimum(g, 7.0).astype(np.float64), np.clip(u, -7.0, 7.0).astype(np.float64)
    ref = gc / (1 + np.exp(-1.702 * gc)) * (uc + 1)
    np.testing.assert_allclose(run(dev, "swiglu_oai", g, u), ref, rtol=1e-5, atol=1e-5)


def test_cont_and_concat_of_column_views(dev):
    """The strided copies deepseek2 takes of its projections: columns of rows, contiguous, and
    two such views side by side."""
    cuda_only(dev)
    rng = np.random.default_rng(28)
    a = rng.standard_normal((70000, 40)).astype(np.float32)  # more rows than one grid dimension
    np.testing.assert_array_equal(_core.cuda_ops.cont_cols(a, 8, 24), a[:, 8:32])
    b = rng.standard_normal((70000, 12)).astype(np.float32)
    np.testing.assert_array_equal(_core.cuda_ops.concat_cols(a, 32, 8, b, 4, 8),
                                  np.concatenate([a[:, 32:40], b[:, 4:12]], axis=1))


# ---- device object ---------------------------------------------------------------------------

def test_allocation_accounting_is_exact(dev):
    cuda_only(dev)
    sizes = [1, 1000, 4096, 12345677, 256 << 20]
    after, final = _core.cuda_ops.alloc_accounting(sizes)
    assert after == list(np.cumsum(sizes))
    assert final == 0


@pytest.mark.parametrize("nbytes", [1, 4 << 20, (9 << 20) + 3])  # one staging buffer, several, odd tail
def test_copies_round_trip(dev, nbytes):
    cuda_only(dev)
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    np.testing.assert_array_equal(_core.cuda_ops.copy_roundtrip(data), data)


def test_peer_copy(dev):
    cuda_only(dev)
    devices, _ = _core.cuda.devices()
    if len(devices) < 2:
        pytest.skip("peer copies need two CUDA devices")
    data = np.random.default_rng(1).integers(0, 256, 5 << 20, dtype=np.uint8)
    np.testing.assert_array_equal(_core.cuda_ops.copy_roundtrip(data, device=0, peer=1), data)


def test_out_of_memory_is_memory_error(dev):
    cuda_only(dev)
    with pytest.raises(MemoryError, match="cannot allocate"):
        _core.cuda_ops.alloc(1 << 50)


def test_missing_device_is_a_clear_error():
    if not hasattr(_core, "cuda_ops"):
        pytest.skip("stowlm was built without CUDA")
    devices, _ = _core.cuda.devices()
    with pytest.raises(RuntimeError, match="no CUDA device"):
        _core.cuda_ops.open_device(len(devices))
