"""GGUF block formats: stowlm.quants against the gguf package's numpy code (the oracle),
bit for bit, plus round-trip bounds and error reporting."""
import zlib

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

from stowlm import quants  # noqa: E402

# Byte offsets of the fp16 scale fields in each block (GGUF layouts, ggml-common.h). IQ1_M keeps
# its fp16 scale in the top nibbles of four words and MXFP4 has a one-byte exponent: both are
# set apart (set_iq1_m_scale; every MXFP4 byte is a valid code).
FP16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "IQ4_NL": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0],
    "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0], "IQ3_S": [0], "IQ1_S": [0],
    "IQ1_M": [], "MXFP4": [],
}
BLOCK_TYPES = list(FP16_FIELDS)
# The formats whose values come from a codebook (grid) indexed by bits of the block.
GRID_TYPES = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"]

# Chosen finite fp16 scales: zeros of both signs, the largest, the smallest normal and
# subnormal, ordinary values of both signs.
EDGE_SCALES = np.array(
    [0.0, -0.0, 1.0, -1.0, 65504.0, -65504.0, 2.0**-14, -(2.0**-14), 2.0**-24, -(2.0**-24),
     0.5, -0.25, 3.140625, 1e-3, -7e-4, 1000.0, -2048.0],
    dtype=np.float16,
)


def random_fp16(rng, n):
    """Finite fp16 values: a mix of edge scales and random magnitudes over the whole range."""
    pick = rng.integers(0, 2, n).astype(bool)
    edge = rng.choice(EDGE_SCALES, n)
    mag = (2.0 ** rng.uniform(-24, 15.9, n)) * rng.choice([-1.0, 1.0], n)
    return np.where(pick, edge, mag.astype(np.float16)).astype(np.float16)


def set_iq1_m_scale(raw, d):
    """IQ1_M's fp16 scale d goes into the top nibbles of the four 16-bit words at byte 48."""
    h = d.astype(np.float16).view(np.uint16)
    words = raw[:, 48:56].copy().view(np.uint16)
    for k in range(4):
        words[:, k] = (words[:, k] & 0x0FFF) | (((h >> (4 * k)) & 0xF) << 12)
    raw[:, 48:56] = words.view(np.uint8)


def random_blocks(rng, name, n_blocks):
    """Random block bytes with finite fp16 scales; some blocks get all-zero / all-one quant
    bytes so the smallest and largest quant values (and scale codes) appear."""
    info = quants.type_info(name)
    raw = rng.integers(0, 256, (n_blocks, info.block_bytes), dtype=np.uint8)
    fill = rng.choice([0x00, 0xFF, 0x55, 0xAA, -1], n_blocks, p=[0.1, 0.1, 0.05, 0.05, 0.7])
    for b in np.nonzero(fill >= 0)[0]:
        raw[b, :] = fill[b]
    for off in FP16_FIELDS[name]:
        raw[:, off:off + 2] = random_fp16(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    if name == "IQ1_M":
        set_iq1_m_scale(raw, random_fp16(rng, n_blocks))
    return raw


def gguf_reference(raw, name):
    """gguf's decode; MXFP4's largest exponents overflow the top levels to inf (as stowlm's)."""
    with np.errstate(over="ignore"):
        return gguf_dequantize(raw, T[name])


def bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_dequantize_bit_exact_with_gguf(name):
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    info = quants.type_info(name)
    raw = random_blocks(rng, name, 24 * 8).reshape(24, 8 * info.block_bytes)
    ref = gguf_reference(raw, name)
    got = quants.dequantize(raw, name, (24, 8 * info.block_elems))
    assert got.dtype == np.float32 and got.shape == ref.shape
    assert not np.isnan(ref).any()
    np.testing.assert_array_equal(bits(got), bits(ref))


@pytest.mark.parametrize("name", GRID_TYPES)
def test_dequantize_grid_types_every_grid_entry(name):
    """4096 random blocks draw each grid entry (at most 2048 of them) about 64 times or more,
    so every codebook entry, sign pattern and scale code is compared with gguf's tables."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    raw = random_blocks(rng, name, 4096)
    ref = gguf_reference(raw, name)
    got = quants.dequantize(raw, name, ref.shape)
    np.testing.assert_array_equal(bits(got), bits(ref))


def test_dequantize_mxfp4_every_exponent():
    """Each E8M0 exponent (0 and 1 give float32 subnormal scales, 254 and 255 overflow the top
    levels to inf) with every 4-bit code."""
    e = np.arange(256, dtype=np.uint8)
    codes = np.arange(16, dtype=np.uint8) * 0x11  # each byte: the same code in both nibbles
    raw = np.concatenate([e[:, None], np.tile(codes, (256, 1))], axis=1)
    ref = gguf_reference(raw, "MXFP4")
    got = quants.dequantize(raw, "MXFP4", ref.shape)
    np.testing.assert_array_equal(bits(got), bits(ref))
    assert np.isinf(got).any() and (got[0] != 0).any()


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "IQ4_XS", "Q5_1", "IQ2_XXS", "IQ1_M", "MXFP4"])
def test_dequantize_large_unaligned_and_buffer_kinds(name):
    # Big enough to be split across the thread pool; the data starts at an odd address.
    rng = np.random.default_rng(7)
    info = quants.type_info(name)
    n_blocks = (1 << 17) // info.block_elems
    raw = random_blocks(rng, name, n_blocks).reshape(-1)
    ref = gguf_reference(raw.reshape(8, -1), name)
    shifted = np.empty(raw.size + 1, np.uint8)[1:]
    shifted[:] = raw
    assert shifted.ctypes.data % 2 == 1
    for src in (shifted, raw.tobytes(), memoryview(raw), bytearray(raw.tobytes()), raw.view(np.int8)):
        got = quants.dequantize(src, T[name], ref.shape)
        np.testing.assert_array_equal(bits(got), bits(ref))


def test_dequantize_q8_K_matches_numpy_reference():
    # gguf-py has no Q8_K decoder: the reference is the format's definition, d * q.
    rng = np.random.default_rng(3)
    n = 16
    raw = rng.integers(0, 256, (n, 292), dtype=np.uint8)
    d = np.concatenate([[0.0, -0.0, 1.0, -3.5e-7, 1e30], rng.standard_normal(n - 5)]).astype(np.float32)
    raw[:, :4] = d.view(np.uint8).reshape(n, 4)
    qs = raw[:, 4:260].view(np.int8).astype(np.float32)
    ref = d[:, None] * qs
    got = quants.dequantize(raw, "Q8_K", (n * 256,)).reshape(n, 256)
    np.testing.assert_array_equal(bits(got), bits(ref))


@pytest.mark.parametrize("name", ["F16", "BF16", "F32"])
def test_dequantize_float_types(name):
    rng = np.random.default_rng(11)
    h = rng.integers(0, 1 << 16, 4096, dtype=np.uint32).astype(np.uint16)
    if name == "F16":
        h[(h & 0x7C00) == 0x7C00] &= 0xFC00  # NaN-free; keeps +-inf
        ref = h.view(np.float16).astype(np.float32)
        raw = h
    elif name == "BF16":
        h[(h & 0x7F80) == 0x7F80] &= 0xFF80
        ref = (h.astype(np.uint32) << 16).view(np.float32)
        raw = h
    else:
        ref = rng.standard_normal(4096).astype(np.float32)
        raw = ref
    got = quants.dequantize(raw.view(np.uint8), name, (64, 64))
    np.testing.assert_array_equal(bits(got), bits(ref).reshape(64, 64))
    if name != "F32":
        np.testing.assert_array_equal(bits(got).ravel(), bits(gguf_dequantize(raw.view(np.uint8), T[name])).ravel())


def quantize_inputs(rng, block):
    """Rows of blocks covering: ordinary data at scales from 1e-6 to 1e3, zero blocks,
    constant blocks, a single outlier, negative and positive extremes of equal magnitude,
    and exact rounding ties for the 8-bit and 4-bit scales."""
    rows = []
    for scale in (1e-6, 1e-2, 1.0, 1e3):
        rows.append(rng.standard_normal(block * 8) * scale)
    rows.append(np.zeros(block * 8))
    rows.append(np.full(block * 8, -2.5))
    r = rng.uniform(-1, 1, block * 8)
    r[3] = 40.0
    rows.append(r)
    r = rng.uniform(-1, 1, block * 8)
    r[::block] = -4.0
    r[1::block] = 4.0
    rows.append(r)
    # Q8_0 with amax 127 has d = 1: halves are exact ties for round-half-away-from-zero.
    r = rng.integers(-126, 126, block * 8) + 0.5
    r[::block] = 127.0
    rows.append(r)
    # Q4_0 with max -8 has d = 1, id = 1: x + 8.5 lands exactly on .5 and integers.
    r = rng.integers(-16, 15, block * 8) / 2.0
    r[::block] = -8.0
    rows.append(r)
    return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16", "F32"])
def test_quantize_bit_exact_with_gguf(name):
    rng = np.random.default_rng(5)
    x = quantize_inputs(rng, 32)
    got = quants.quantize(x, name)
    ref = np.asarray(gguf_quantize(x, T[name]))
    ref = np.ascontiguousarray(ref).view(np.uint8).reshape(got.shape)
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, ref)


def test_quantize_float_type_edges_bit_exact():
    x = np.array([0.0, -0.0, 65504.0, 65519.99, 65520.0, 1e9, -1e9, 2.0**-24, 2.0**-25,
                  3 * 2.0**-26, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, np.inf, -np.inf,
                  1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 3.4e38, 1e-40], np.float32)
    x = np.concatenate([x, np.zeros(32 - x.size, np.float32)])
    with np.errstate(over="ignore"):
        ref = x.astype(np.float16)
    np.testing.assert_array_equal(quants.quantize(x, "F16"), ref.view(np.uint8))
    with_nan = x.copy()
    with_nan[-1] = np.nan
    np.testing.assert_array_equal(quants.quantize(with_nan, "BF16"),
                                  np.asarray(gguf_quantize(with_nan, T.BF16)).view(np.uint8))


def block_view(x, block):
    return x.reshape(-1, block).astype(np.float64)


# Per-element bound on |x - dequantize(quantize(x))| for each quantizer, from its definition:
# rounding to the nearest level costs half a step (a full step where the top level clamps),
# and storing d (and the min) as fp16 moves every level by at most q_max * |d| * 2^-11.
def bound(name, xb):
    amax = np.abs(xb).max(axis=1, keepdims=True)
    slack = 1e-5 * amax  # float32 rounding of x * (1/d) near a tie
    fp16 = 2.0**-11
    if name == "Q8_0":
        d = amax / 127
        return d * (0.5 + 127 * fp16) + slack
    if name in ("Q4_0", "Q5_0"):
        half = 8 if name == "Q4_0" else 16
        mx = np.take_along_axis(xb, np.abs(xb).argmax(axis=1)[:, None], axis=1)
        d = mx / -half
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(d == 0, 0, xb / d)
        over = np.maximum(0, t - (half - 0.5))  # above the top level: clamped
        return np.abs(d) * (0.5 + over + half * fp16) + slack
    if name in ("Q4_1", "Q5_1"):
        top = 15 if name == "Q4_1" else 31
        mn, mx = xb.min(axis=1, keepdims=True), xb.max(axis=1, keepdims=True)
        d = (mx - mn) / top
        return d * (0.5 + top * fp16) + np.abs(mn) * fp16 + slack
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantize_round_trip_error_bound(name):
    rng = np.random.default_rng(9)
    # scales keep d a normal fp16 number, where the 2^-11 relative bound holds
    x = (rng.standard_normal((64, 256)) * 10.0 ** rng.uniform(-1, 3, (64, 1))).astype(np.float32)
    x[0, :32] = 0.0
    y = quants.dequantize(quants.quantize(x, name), name, x.shape)
    xb = block_view(x, 32)
    err = np.abs(block_view(y, 32) - xb)
    assert (err <= bound(name, xb)).all()
    # and the bound is not vacuous: the error reaches a good part of it somewhere
    assert (err / np.maximum(bound(name, xb), 1e-30)).max() > 0.3


# Half an ulp relative, or half the smallest subnormal step where F16 goes subnormal.
@pytest.mark.parametrize("name,rel,floor", [("F16", 2.0**-11, 2.0**-25), ("BF16", 2.0**-8, 0.0)])
def test_float_round_trip_relative_error(name, rel, floor):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(4096) * 10.0 ** rng.uniform(-3, 3, 4096)).astype(np.float32)
    y = quants.dequantize(quants.quantize(x, name), name, x.shape)
    err = np.abs(y.astype(np.float64) - x)
    assert (err <= np.maximum(rel * np.abs(x), floor)).all()
    assert err.max() > 0


def q8_K_reference(x):
    """ggml's quantize_row_q8_K_ref in numpy: iscale = -127 / (signed value of largest
    magnitude), q = min(127, round half to even(iscale * x)), d = 1 / iscale."""
    blocks = x.reshape(-1, 256).astype(np.float32)
    mx = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)
    with np.errstate(divide="ignore"):
        iscale = np.where(mx == 0, np.float32(0), np.float32(-127.0) / mx).astype(np.float32)
    q = np.minimum(127, np.rint(iscale * blocks)).astype(np.int8)
    with np.errstate(divide="ignore"):
        d = np.where(iscale == 0, np.float32(0), np.float32(1.0) / iscale).astype(np.float32)
    return d.ravel(), q


def test_quantize_q8_K():
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((6, 512)) * 10.0 ** rng.uniform(-4, 4, (6, 1))).astype(np.float32)
    x[1, :256] = 0.0
    x[2, 256:] = rng.integers(-100, 100, 256) + 0.5  # ties: -127/max scaling keeps some
    x[2, 256] = -127.0
    big = 10 * np.abs(x[3]).max()
    x[3, 10], x[3, 20] = big, -big  # equal magnitudes: the first one sets the sign of iscale
    raw = quants.quantize(x, "Q8_K")
    assert raw.shape == (6, 2 * 292)
    blocks = raw.reshape(-1, 292)
    d = blocks[:, :4].copy().view(np.float32).ravel()
    qs = blocks[:, 4:260].view(np.int8)
    bsums = blocks[:, 260:].copy().view(np.int16)
    ref_d, ref_q = q8_K_reference(x)
    np.testing.assert_array_equal(bits(d), bits(ref_d))
    np.testing.assert_array_equal(qs, ref_q)
    np.testing.assert_array_equal(bsums, qs.reshape(-1, 16, 16).astype(np.int64).sum(axis=2))
    # round trip: within half a step (plus float32 rounding of iscale * x) of the input
    y = quants.dequantize(raw, "Q8_K", x.shape).reshape(-1, 256)
    xb = x.reshape(-1, 256).astype(np.float64)
    assert (np.abs(y - xb) <= np.abs(d)[:, None] * (0.5 + 1e-5)).all()


def test_type_info_matches_gguf():
    for t in T:
        try:
            info = quants.type_info(t)
        except ValueError:
            continue  # ids stowlm does not know at all
        assert info.name == t.name and info.id == int(t)
        if not info.decodable:
            continue  # gguf-py's size for Q8_1 is stale (40 vs ggml's 36); never stored in files
        assert info.name == t.name and info.id == int(t)
        assert (info.block_elems, info.block_bytes) == gguf.GGML_QUANT_SIZES[t]
    assert quants.type_info("q4_k") == quants.type_info(12) == quants.type_info(T.Q4_K)
    assert quants.type_info(np.int32(8)).name == "Q8_0"
    info = quants.type_info("IQ4_XS")
    assert info.decodable and not info.quantizable and info.row_bytes(512) == 272


def test_errors_name_the_problem():
    raw = np.zeros(144, np.uint8)
    with pytest.raises(ValueError, match=r"144 bytes, got 143 bytes"):
        quants.dequantize(raw[:143], "Q4_K", (256,))
    with pytest.raises(ValueError, match=r"must be 288 bytes, got 144"):
        quants.dequantize(raw, "Q4_K", (2, 256))
    with pytest.raises(ValueError, match=r"unknown tensor type id 99"):
        quants.dequantize(raw, 99, (256,))
    with pytest.raises(ValueError, match=r"unknown tensor type name 'Q9_K'"):
        quants.dequantize(raw, "q9_k", (256,))
    with pytest.raises(ValueError, match=r"TQ1_0 .*not supported"):
        quants.dequantize(raw, T.TQ1_0, (256,))
    with pytest.raises(ValueError, match=r"last dimension 128 is not a multiple of the Q4_K block size 256"):
        quants.dequantize(raw, "Q4_K", (2, 128))
    with pytest.raises(ValueError, match=r"must be a name or an integer id"):
        quants.type_info(1.5)
    with pytest.raises(ValueError, match=r"raw data must be bytes"):
        quants.dequantize(12345, "Q8_0", (32,))
    x = np.ones((2, 48), np.float32)
    with pytest.raises(ValueError, match=r"last dimension 48 is not a multiple of the Q8_0 block size 32"):
        quants.quantize(x, "Q8_0")
    with pytest.raises(ValueError, match=r"quantizing to Q4_K .*not implemented"):
        quants.quantize(np.ones(256, np.float32), "Q4_K")
    with pytest.raises(ValueError, match=r"unknown tensor type id 1000"):
        quants.quantize(x, 1000)


def test_native_entry_points_check_sizes():
    from stowlm._core import quants as native

    with pytest.raises(ValueError, match=r"must be 34 bytes, got 33"):
        native.dequantize_into(np.zeros(33, np.uint8), 8, np.empty(32, np.float32))
    with pytest.raises(ValueError, match=r"not a multiple of the Q8_0 block size 32"):
        native.dequantize_into(np.zeros(34, np.uint8), 8, np.empty(31, np.float32))
    with pytest.raises(ValueError, match=r"must be 34 bytes, got 35"):
        native.quantize_into(np.zeros(32, np.float32), 8, np.empty(35, np.uint8))
    with pytest.raises(ValueError, match=r"Q8_1 .*not supported"):
        native.dequantize_into(np.zeros(36, np.uint8), 9, np.empty(32, np.float32))


def test_quantize_q3_K_rounds_to_the_nearest_step():
    """Q3_K (stowlm's own quantizer; gguf-py has none), decoded by the gguf package: a value not
    at either end of its sub-block's range (-4 or +3 steps of d * scale) is within half a step
    of the input; the error overall is a 3-bit format's; an all-zero super-block stays 0."""
    rng = np.random.default_rng(12)
    x = (rng.standard_normal((32, 512)) * 10.0 ** rng.uniform(-2, 2, (32, 1))).astype(np.float32)
    x[0, :256] = 0.0
    raw = quants.quantize(x, "Q3_K")
    assert raw.shape == (32, 2 * 110)
    y = gguf_dequantize(raw, T.Q3_K).reshape(x.shape)
    assert (y[0, :256] == 0).all()
    blocks = raw.reshape(-1, 110)
    d = blocks[:, 108:110].copy().view(np.float16).astype(np.float32).reshape(-1)
    step = (d[:, None] * np.array([[q3k_scale(b[96:108], j) for j in range(16)] for b in blocks])).reshape(-1, 1)
    q = np.divide(y.reshape(-1, 16), step, out=np.zeros((step.size, 16), np.float32), where=step != 0)
    inside = (np.abs(q - np.round(q)) < 1e-3) & (np.round(q) > -4) & (np.round(q) < 3)
    err = np.abs(y - x).reshape(-1, 16)
    assert inside.mean() > 0.8
    assert (err[inside] <= (np.abs(step) * 0.5 * (1 + 1e-3) + 1e-30).repeat(16, 1)[inside]).all()
    rel = np.sqrt(((y - x) ** 2).mean(1) / (x ** 2).mean(1))[1:]
    assert rel.max() < 0.2


def q3k_scale(scales, j):
    """The signed 6-bit scale of sub-block j of a Q3_K block's 12 packed bytes (ggml's layout)."""
    lo = scales[j] & 0xF if j < 8 else scales[j - 8] >> 4
    hi = (scales[8 + (j & 3)] >> (2 * (j >> 2))) & 3
    return int(lo | (hi << 4)) - 32
