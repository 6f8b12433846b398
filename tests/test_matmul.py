"""CPU quantized matmul against an independent oracle: the weights dequantized by the `gguf`
package's numpy code (Q8_K, which gguf does not decode, by a one-line numpy formula), times the
activations rounded to 8 bits as llama.cpp does for each weight type (numpy models of its Q8_0
and Q8_K activation quantizers below), in float64. Every weight type runs on every kernel path
this CPU offers."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import subprocess_env

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize  # noqa: E402

from stowlm import ops  # noqa: E402

T = gguf.GGMLQuantizationType
# The grid i-quants and MXFP4 (weights of IQ1/IQ2/IQ3 and gpt-oss models).
NEW_TYPES = ["MXFP4", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"]
TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
         "Q6_K", "Q8_K", "IQ4_NL", "IQ4_XS"] + NEW_TYPES
# Weight types whose activations are rounded per 32 values (llama.cpp's Q8_0 for them); every
# other quantized type is rounded per 256 (llama.cpp's Q8_K).
ACT32_TYPES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4"}
ISAS = ["scalar", "avx2", "avx512", "amx"]
# (rows, cols, n_tok): rows that no tile divides, several token counts, both column sizes;
# 96, 288 and 320 columns (32-element formats only: 3, 9 and 10 blocks) hit the single-block
# tails and every partial group of the four-block Q4_0/Q4_1 kernels;
# 67 and 40 tokens reach the batched paths (24+: GEMM or AMX) with partial token tiles; 64 rows
# x 1 token the decoding kernels (4-row tiles, one token).
SHAPES = [(1, 256, 1), (7, 512, 2), (33, 256, 3), (131, 512, 8), (33, 512, 17), (131, 256, 67),
          (5, 288, 3), (9, 96, 40), (64, 512, 1), (13, 320, 1), (6, 320, 5)]

# Byte offsets of the fp16 scale fields within a block, set to sane values in random blocks
# (random bytes elsewhere exercise every bit pattern of the quants and sub-scales). MXFP4's
# one-byte exponent and IQ1_M's scale (top nibbles of its four scale words) are set apart.
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "IQ4_NL": [0],
              "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
              "IQ4_XS": [0], "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0], "IQ3_S": [0],
              "IQ1_S": [0], "IQ1_M": [], "MXFP4": []}


def set_scales(blocks, name, rng):
    """Sane scales in random blocks: signed fp16 d (the min, where present, positive as quantizers
    make it), MXFP4 exponents for scales 2^-10..2^-5."""
    nb = len(blocks)
    for k, off in enumerate(F16_FIELDS[name]):
        v = rng.uniform(0.002, 0.02, nb) * (rng.choice([-1, 1], nb) if k == 0 else 1)
        blocks[:, off:off + 2] = v.astype(np.float16).view(np.uint8).reshape(nb, 2)
    if name == "MXFP4":
        blocks[:, 0] = rng.integers(118, 124, nb)
    if name == "IQ1_M":
        h = (rng.uniform(0.002, 0.02, nb) * rng.choice([-1, 1], nb)).astype(np.float16).view(np.uint16)
        words = blocks[:, 48:56].copy().view(np.uint16)
        for k in range(4):
            words[:, k] = (words[:, k] & 0x0FFF) | (((h >> (4 * k)) & 0xF) << 12)
        blocks[:, 48:56] = words.view(np.uint8)


def make_weights(name, rows, cols, rng):
    """Random GGUF bytes of type `name`, shape (rows, row_bytes), and their float64 values."""
    if name == "F32":
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        return w.view(np.uint8), w.astype(np.float64)
    if name == "F16":
        w = rng.standard_normal((rows, cols)).astype(np.float16)
        return w.view(np.uint8), w.astype(np.float64)
    if name == "BF16":
        bits = (rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return bits.view(np.uint8), (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    belems, bbytes = gguf.GGML_QUANT_SIZES[T[name]]
    nb = rows * cols // belems
    blocks = rng.integers(0, 256, size=(nb, bbytes), dtype=np.uint8)
    if name == "Q8_K":
        blocks[:, 0:4] = rng.uniform(0.001, 0.02, nb).astype(np.float32).view(np.uint8).reshape(nb, 4)
        d = blocks[:, 0:4].copy().view(np.float32)
        q = blocks[:, 4:260].view(np.int8).astype(np.float64)
        return blocks.reshape(rows, -1), (d.astype(np.float64) * q).reshape(rows, cols)
    set_scales(blocks, name, rng)
    raw = blocks.reshape(rows, -1)
    ref = dequantize(raw, T[name]).astype(np.float64).reshape(rows, cols)
    return raw, ref


def quantize_act32(x):
    """The activations as the paths of the 32-element formats round them (llama.cpp's Q8_0):
    per 32 elements, scale d = max|x| / 127 (float32), q = round(x / d) to the nearest integer;
    returns d * q in float64 and, per element, the size of one step where x / d lies on a rounding
    tie (SIMD rounds ties to even, the scalar path away from zero)."""
    n, cols = x.shape
    xb = x.astype(np.float32).reshape(n, cols // 32, 32)
    d = (np.abs(xb).max(axis=2, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    v = (xb * inv).astype(np.float32)
    q = np.sign(v) * np.floor(np.abs(v) + 0.5)
    tie = np.abs(v - np.trunc(v)) == 0.5
    deq = (q * d).astype(np.float64).reshape(n, cols)
    return deq, (tie * d).astype(np.float64).reshape(n, cols)


def quantize_act_q8_K(x):
    """ggml's quantize_row_q8_K_ref in numpy (float32 throughout): per 256 elements iscale =
    -127 / (the first value of largest magnitude), q = min(127, round half to even(iscale * x)),
    d = 1 / iscale; an all-zero block gives zeros. Returns (d per block, q int8, d * q float64)."""
    n, cols = x.shape
    b = x.astype(np.float32).reshape(n, cols // 256, 256)
    mx = np.take_along_axis(b, np.abs(b).argmax(axis=2)[..., None], axis=2)
    with np.errstate(divide="ignore"):
        iscale = np.where(mx == 0, np.float32(0), np.float32(-127.0) / mx).astype(np.float32)
    q = np.minimum(127, np.rint((iscale * b).astype(np.float32))).astype(np.int8)
    with np.errstate(divide="ignore"):
        d = np.where(iscale == 0, np.float32(0), np.float32(1.0) / iscale).astype(np.float32)
    return d[..., 0], q, (q.astype(np.float64) * d.astype(np.float64)).reshape(n, cols)


def check(name, y, ref_w, x):
    x64 = x.astype(np.float64)
    mag = np.abs(x64) @ np.abs(ref_w).T
    if name in ("F32", "F16", "BF16"):
        # no activation rounding, only the float32 accumulation
        ref, slack = x64 @ ref_w.T, 0.0
    elif name in ACT32_TYPES:
        # Activations rounded to 8 bits with one scale per 32 elements: the products must equal
        # the weights times those rounded activations up to float32 accumulation (1e-5 relative),
        # plus one step per rounding tie.
        xq, tie = quantize_act32(x)
        ref, slack = xq @ ref_w.T, tie @ np.abs(ref_w).T
    else:
        # The K formats and the 256-element i-quants: Q8_K activations, one scale per 256, ties to
        # even on every path, so exactly these rounded activations (up to float32 accumulation).
        ref, slack = quantize_act_q8_K(x)[2] @ ref_w.T, 0.0
    bound = 1e-5 * mag + slack + 1e-30
    err = np.abs(y - ref)
    assert np.all(err <= bound), (name, float((err / bound).max()))


def with_outliers(x, rng):
    """A few activations 30x larger, as real models have (they set the per-32 and per-256
    scales, and a wrong choice of rounding block shows at once)."""
    x = x.copy()
    for t in range(x.shape[0]):
        idx = rng.integers(0, x.shape[1], size=max(1, x.shape[1] // 256))
        x[t, idx] *= 30
    return x


@pytest.fixture
def restore_isa():
    yield
    ops.set_isa(ops.cpu_info()["best"])


_WCACHE = {}


def weights(name, rows, cols):
    key = (name, rows, cols)
    if key not in _WCACHE:
        _WCACHE[key] = make_weights(name, rows, cols, np.random.default_rng(hash(key) & 0xffff))
    return _WCACHE[key]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", TYPES)
def test_matmul_all_types(name, isa, restore_isa):
    if isa not in ops.cpu_info()["supported"]:
        pytest.skip(f"this CPU/OS cannot run the {isa} path: {ops.cpu_info()['flags']}")
    ops.set_isa(isa)
    assert ops.cpu_info()["active"] == isa
    belems = gguf.GGML_QUANT_SIZES[T[name]][0]
    rng = np.random.default_rng(7)
    for rows, cols, n_tok in SHAPES:
        if cols % belems:
            continue
        raw, ref_w = weights(name, rows, cols)
        x = with_outliers((rng.standard_normal((n_tok, cols)) * rng.uniform(0.1, 3)).astype(np.float32), rng)
        y = ops.matmul(raw, name, x)
        assert y.shape == (n_tok, rows) and y.dtype == np.float32
        check(name, y.astype(np.float64), ref_w, x)
        y2 = ops.matmul(raw, name, x, threads=2)
        check(name, y2.astype(np.float64), ref_w, x)


# Every type with a fused row kernel on some path (the others run the panel path, also checked).
ROW_KERNEL_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K",
                    "IQ4_XS", "F16"] + NEW_TYPES


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", ROW_KERNEL_TYPES)
def test_token_result_independent_of_batch(name, isa, restore_isa):
    """Below the batched kernels (1 to 23 tokens: the row kernels' tiles of several tokens and
    their tails) a token's product is bit-identical alone (the decoding kernel) and inside a
    batch of any size: the models' micro-batch results and the server's continuous batching
    rely on it (an ulp flips 8-bit roundings of later activations). 131 rows: every row tile
    and its tail; for the 32-element formats 320 columns (10 blocks: a partial four-block group)
    and 288 (9: the odd-block kernels)."""
    if isa not in ops.cpu_info()["supported"]:
        pytest.skip(f"this CPU/OS cannot run the {isa} path")
    ops.set_isa(isa)
    rng = np.random.default_rng(5)
    for cols in ([320, 288] if name in ACT32_TYPES else [512]):
        raw, _ = weights(name, 131, cols)
        x = with_outliers(rng.standard_normal((23, cols)).astype(np.float32), rng)
        alone = np.stack([ops.matmul(raw, name, x[t:t + 1])[0] for t in range(23)])
        for k in range(1, 24):
            start = (7 * k) % (24 - k)  # tokens from several places of x
            y = ops.matmul(raw, name, x[start:start + k], threads=1 + k % 2)
            np.testing.assert_array_equal(y, alone[start:start + k], err_msg=f"{name} {isa}: {k} tokens, {cols} cols")


@pytest.mark.parametrize("isa", ISAS)
def test_batch_result_independent_of_position(isa, restore_isa):
    """In batches big enough for the batched kernels (24+ tokens: the GEMMs' register tiles of
    8 or 4 tokens with their tails, or AMX tiles), a token's product does not depend on
    where it sits in the batch nor on the batch's size: prompts split into micro-batches rely
    on it."""
    if isa not in ops.cpu_info()["supported"]:
        pytest.skip(f"this CPU/OS cannot run the {isa} path")
    ops.set_isa(isa)
    rng = np.random.default_rng(11)
    for name in ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q2_K", "Q4_K", "Q6_K", "IQ4_XS"] + NEW_TYPES:
        raw, _ = weights(name, 131, 512)
        x = with_outliers(rng.standard_normal((45, 512)).astype(np.float32), rng)
        y = ops.matmul(raw, name, x)
        perm = rng.permutation(45)
        np.testing.assert_array_equal(ops.matmul(raw, name, x[perm], threads=2), y[perm], err_msg=name)
        np.testing.assert_array_equal(ops.matmul(raw, name, x[:29]), y[:29], err_msg=name)


# Groups as a decoder layer has them (q/k/v, gate/up), plus ones mixing activation formats
# (Q8_0 with Q4_K, MXFP4 with IQ2_XXS: the one-at-a-time fallback).
MULTI_GROUPS = [[("Q4_1", 131), ("Q4_1", 33), ("Q4_1", 7)], [("Q4_K", 33), ("Q6_K", 131)],
                [("Q8_0", 33), ("Q4_K", 7)], [("Q5_0", 9), ("Q8_0", 33), ("Q5_0", 1), ("Q4_0", 131)],
                [("IQ2_XXS", 33), ("IQ3_S", 131), ("IQ1_M", 7)], [("IQ2_XS", 9), ("IQ2_S", 33), ("IQ3_XXS", 131), ("IQ1_S", 7)],
                [("MXFP4", 33), ("IQ2_XXS", 7)]]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group", range(len(MULTI_GROUPS)))
def test_matmul_multi_equals_single(group, isa, restore_isa):
    """One pass over several weights sharing x gives each product exactly as matmul alone does."""
    if isa not in ops.cpu_info()["supported"]:
        pytest.skip(f"this CPU/OS cannot run the {isa} path")
    ops.set_isa(isa)
    from stowlm import _core
    cols = 512
    rng = np.random.default_rng(group)
    ws = [(name, rows) + weights(name, rows, cols) for name, rows in MULTI_GROUPS[group]]
    for n_tok in (1, 3, 40):
        x = with_outliers(rng.standard_normal((n_tok, cols)).astype(np.float32), rng)
        for threads in (1, 2):
            ys = _core.ops.matmul_multi_raw([(raw.reshape(-1), int(T[name]), rows) for name, rows, raw, _ in ws],
                                            cols, x, threads)
            assert len(ys) == len(ws)
            for (name, rows, raw, ref_w), y in zip(ws, ys):
                assert y.shape == (n_tok, rows)
                check(name, y.astype(np.float64), ref_w, x)
                np.testing.assert_array_equal(y, ops.matmul(raw, name, x, threads=threads))


@pytest.mark.parametrize("name", ["Q4_K", "IQ2_XXS", "Q8_0", "MXFP4"])
def test_activation_quantization_matches_llama_cpp_on_every_isa(name, restore_isa):
    """The activation bytes matmul makes: for the 256-element formats exactly llama.cpp's Q8_K
    (per 256 values one scale, the same for all eight 32-groups of block_q8_K32, and the sums of
    each 16) on every path; for the 32-element ones per 32 values within half a step (ties may
    round either way between paths)."""
    rng = np.random.default_rng(8)
    x = with_outliers(rng.standard_normal((5, 1024)).astype(np.float32), rng)
    x[1, :256] = 0.0  # a zero block
    x[2, 300], x[2, 310] = 50.0, -50.0  # equal magnitudes: the first sets the sign of the scale
    x[3, 512:768] = rng.integers(-100, 100, 256) + 0.5  # ties of iscale * x: d = 1 when max is -127
    x[3, 600] = -127.0
    seen = []
    for isa in ops.cpu_info()["supported"]:
        ops.set_isa(isa)
        raw = _core_ops().quantize_act_raw(x, int(T[name]))
        seen.append(raw)
        if name in ACT32_TYPES:
            blk = raw.reshape(5, -1, 40)
            d = blk[..., 0:4].copy().view(np.float32)[..., 0]
            q = blk[..., 8:40].view(np.int8).astype(np.float64)
            xb = x.reshape(5, -1, 32).astype(np.float64)
            np.testing.assert_array_equal(d, (np.abs(x.reshape(5, -1, 32)).max(axis=2) / np.float32(127)).astype(np.float32))
            assert np.all(np.abs(q * d[..., None] - xb) <= 0.5 * d[..., None] * (1 + 1e-6) + 1e-30)
            continue
        blk = raw.reshape(5, -1, 320)
        d = blk[..., 0:32].copy().view(np.float32)
        bsums = blk[..., 32:64].copy().view(np.int16)
        q = blk[..., 64:320].view(np.int8)
        ref_d, ref_q, _ = quantize_act_q8_K(x)
        np.testing.assert_array_equal(d, np.repeat(ref_d[..., None], 8, axis=2), err_msg=isa)
        np.testing.assert_array_equal(q, ref_q, err_msg=isa)
        np.testing.assert_array_equal(bsums, q.reshape(5, -1, 16, 16).astype(np.int64).sum(axis=3), err_msg=isa)
        np.testing.assert_array_equal(raw, seen[0], err_msg=f"{isa} differs from {ops.cpu_info()['supported'][0]}")
        assert not d[1, 0].any() and not q[1, 0].any()  # the zero block


def _core_ops():
    from stowlm import _core
    return _core.ops


def test_matmul_multi_errors():
    from stowlm import _core
    raw, _ = weights("Q4_0", 7, 512)
    x = np.zeros((2, 512), np.float32)
    with pytest.raises(ValueError, match="between 1 and"):
        _core.ops.matmul_multi_raw([], 512, x)
    with pytest.raises(ValueError, match="weight 1 has"):
        _core.ops.matmul_multi_raw([(raw.reshape(-1), int(T["Q4_0"]), 7), (raw.reshape(-1)[:-1], int(T["Q4_0"]), 7)],
                                   512, x)
    with pytest.raises(ValueError, match="columns"):
        _core.ops.matmul_multi_raw([(raw.reshape(-1), int(T["Q4_0"]), 7)], 256, x)


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_matmul_vector_and_flat(name):
    rows, cols = 33, 512
    raw, ref_w = weights(name, rows, cols)
    x = np.random.default_rng(1).standard_normal(cols).astype(np.float32)
    y = ops.matmul(raw, name, x)
    assert y.shape == (rows,)
    check(name, y[None, :].astype(np.float64), ref_w, x[None, :])
    y2 = ops.matmul(raw.reshape(-1), int(T[name]), x, rows=rows, cols=cols)
    np.testing.assert_array_equal(y, y2)


def test_matmul_errors():
    raw, _ = weights("Q4_0", 7, 512)
    x = np.zeros((2, 512), np.float32)
    with pytest.raises(ValueError, match="unknown weight type"):
        ops.matmul(raw, "Q9_9", x)
    with pytest.raises(ValueError):
        ops.matmul(raw, 99, x)
    with pytest.raises(ValueError, match="columns"):
        ops.matmul(raw, "Q4_0", np.zeros((2, 256), np.float32))
    with pytest.raises(ValueError, match="bytes"):
        ops.matmul(raw.reshape(-1)[:-1], "Q4_0", x, rows=7, cols=512)
    with pytest.raises(ValueError, match="multiple"):
        ops.matmul(raw.reshape(-1), "Q4_0", np.zeros((2, 500), np.float32), rows=7, cols=500)
    with pytest.raises(ValueError, match="multiple"):
        kraw, _ = weights("Q4_K", 7, 512)
        ops.matmul(kraw.reshape(-1)[:7 * 144], "Q4_K", np.zeros((2, 224), np.float32), rows=7, cols=224)
    iraw, _ = weights("IQ2_XXS", 7, 512)
    with pytest.raises(ValueError, match="not a positive multiple of the IQ2_XXS block size 256"):
        ops.matmul(iraw.reshape(-1)[:7 * 66], "IQ2_XXS", np.zeros((2, 224), np.float32), rows=7, cols=224)
    with pytest.raises(ValueError, match="IQ1_M"):
        _core_ops().quantize_act_raw(np.zeros((1, 100), np.float32), int(T["IQ1_M"]))
    with pytest.raises(ValueError, match="float32"):
        ops.matmul(raw, "Q4_0", x.astype(np.float64))
    with pytest.raises(ValueError, match="uint8"):
        ops.matmul(raw.view(np.int8), "Q4_0", x)
    with pytest.raises(ValueError, match="unknown ISA"):
        ops.set_isa("sse9")


def test_cpu_info_consistent():
    info = ops.cpu_info()
    assert info["best"] == info["supported"][-1]
    assert "scalar" in info["supported"]
    if "amx" in info["supported"]:
        assert {"amx_tile", "amx_int8", "avx512vnni"} <= set(info["flags"])
    if "avx512" in info["supported"]:
        assert {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni"} <= set(info["flags"])


def _run_py(code, env_extra=None):
    env = subprocess_env(**(env_extra or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=120)


def test_isa_env_var_forces_lower_path():
    supported = ops.cpu_info()["supported"]
    for isa in supported:
        r = _run_py("from stowlm import ops; print(ops.cpu_info()['active'])", {"STOWLM_ISA": isa})
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == isa


def test_set_isa_refuses_missing():
    missing = [i for i in ISAS if i not in ops.cpu_info()["supported"]]
    if not missing:
        pytest.skip("this CPU runs every path; nothing to refuse")
    with pytest.raises(RuntimeError, match=missing[0]):
        ops.set_isa(missing[0])


def test_amx_fresh_process_other_threads():
    """AMX tiles fault (SIGILL) unless the process asked Linux for permission first; run the
    AMX path in a fresh interpreter, from a non-main thread and from pool worker threads."""
    if "amx" not in ops.cpu_info()["supported"]:
        print("skipping: no AMX on this CPU/OS; flags:", ops.cpu_info()["flags"])
        pytest.skip("CPU/OS without AMX-INT8")
    code = """
        import threading, numpy as np, gguf
        from gguf.quants import dequantize
        from stowlm import ops
        ops.set_isa('amx')
        rng = np.random.default_rng(3)
        out = {}
        def work(name):
            belems, bbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
            rows, cols, n = 64, 512, 64
            blocks = rng.integers(0, 256, size=(rows * cols // belems, bbytes), dtype=np.uint8)
            for off in {'Q6_K': [208], 'Q4_K': [0, 2]}.get(name, [0]):
                blocks[:, off:off + 2] = np.full(len(blocks), 0.01, np.float16).view(np.uint8).reshape(-1, 2)
            raw = blocks.reshape(rows, -1)
            w = dequantize(raw, gguf.GGMLQuantizationType[name]).astype(np.float64)
            x = rng.standard_normal((n, cols)).astype(np.float32)
            y = ops.matmul(raw, name, x, threads=2)
            ref = x.astype(np.float64) @ w.T
            bound = np.abs(w).sum(1)[None, :] * np.abs(x).max(1, keepdims=True) / 254 + 1e-4
            out[name] = bool(np.all(np.abs(y - ref) <= bound))
        ts = [threading.Thread(target=work, args=(n,)) for n in ['Q4_0', 'Q8_0', 'Q4_K', 'Q6_K']]
        for t in ts: t.start()
        for t in ts: t.join()
        print(ops.cpu_info()['active'], sorted(out.items()))
    """
    r = _run_py(code)
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert r.stdout.split()[0] == "amx"
    assert "False" not in r.stdout and r.stdout.count("True") == 4, r.stdout
