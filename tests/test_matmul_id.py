"""mul_mat_id (expert products) against a numpy reference: the experts dequantized by the `gguf`
package, each (token, slot) product in float64, on every kernel path this CPU offers."""
import zlib

import numpy as np
import pytest

from test_matmul import NEW_TYPES, check as check_dense, make_weights

gguf = pytest.importorskip("gguf")
from stowlm import ops  # noqa: E402

TYPES = ["F32", "Q4_0", "Q8_0", "Q4_K", "Q6_K"] + NEW_TYPES
ISAS = ["scalar", "avx2", "avx512", "amx"]
N_EXPERT, ROWS, COLS = 6, 20, 256

_W = {}


def experts(name):
    if name not in _W:
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        parts = [make_weights(name, ROWS, COLS, rng) for _ in range(N_EXPERT)]
        _W[name] = (np.concatenate([p[0].reshape(-1) for p in parts]), [p[1] for p in parts])
    return _W[name]


def check(name, y, ref_w, x, ids):
    n_tok, k = ids.shape
    assert y.shape == (n_tok, k, ROWS)
    for t in range(n_tok):
        for j in range(k):
            xr = x[t, j if x.shape[1] > 1 else 0][None, :]
            check_dense(name, y[t, j][None, :].astype(np.float64), ref_w[ids[t, j]], xr)


@pytest.fixture
def restore_isa():
    yield
    ops.set_isa(ops.cpu_info()["best"])


def picks(rng, n_tok, k):
    return np.stack([rng.permutation(N_EXPERT)[:k] for _ in range(n_tok)]).astype(np.int32)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", TYPES)
def test_mul_mat_id(name, isa, restore_isa):
    if isa not in ops.cpu_info()["supported"]:
        pytest.skip(f"this CPU/OS cannot run the {isa} path")
    ops.set_isa(isa)
    raw, ref_w = experts(name)
    rng = np.random.default_rng(3)
    # (n_tok, k, x per slot?): k from 1 to n_expert, batch sizes 1..67 (67 reaches AMX groups)
    cases = [(1, 1, False), (2, 2, True), (5, 3, False), (9, 4, True), (30, 5, False), (67, 6, False), (40, 2, True)]
    for n_tok, k, per_slot in cases:
        ids = picks(rng, n_tok, k)
        x = rng.standard_normal((n_tok, k if per_slot else 1, COLS)).astype(np.float32)
        y = ops.mul_mat_id(raw, name, N_EXPERT, ROWS, COLS, x, ids)
        check(name, y, ref_w, x, ids)
    # Every token picks the same one expert (one group of 67: AMX where it runs); experts 0-4 idle.
    ids = np.full((67, 1), 5, np.int32)
    x = rng.standard_normal((67, 1, COLS)).astype(np.float32)
    check(name, ops.mul_mat_id(raw, name, N_EXPERT, ROWS, COLS, x, ids, threads=3), ref_w, x, ids)


@pytest.mark.parametrize("name", ["Q4_0", "Q6_K"])
def test_mul_mat_id_permutation_and_dense(name):
    """Shuffling the tokens permutes the outputs the same way (bit for bit), and each slot equals
    the dense matmul of that expert alone."""
    raw, ref_w = experts(name)
    rng = np.random.default_rng(11)
    n_tok, k = 37, 3
    ids = picks(rng, n_tok, k)
    ids[:, 0] = rng.integers(0, 2, n_tok)  # only experts 0-3 ...
    ids[:, 1] = 2 + (ids[:, 0] == 0)
    ids[:, 2] = 4 - ids[:, 0]  # ... never expert 5
    x = rng.standard_normal((n_tok, COLS)).astype(np.float32)
    y = ops.mul_mat_id(raw, name, N_EXPERT, ROWS, COLS, x, ids)
    perm = rng.permutation(n_tok)
    y_p = ops.mul_mat_id(raw, name, N_EXPERT, ROWS, COLS, x[perm], ids[perm])
    np.testing.assert_array_equal(y_p, y[perm])
    rb = len(raw) // N_EXPERT
    for e in range(N_EXPERT - 1):
        t, j = np.nonzero(ids == e)
        if len(t) == 0:
            continue
        dense = ops.matmul(raw[e * rb:(e + 1) * rb].reshape(ROWS, -1), name, x[t])
        np.testing.assert_allclose(y[t, j], dense, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K", "F32", "MXFP4", "IQ2_XXS"])
def test_mul_mat_id_every_batch_size(name):
    """n_tok = 1..67 with k = 1..n_expert in turn, against the float64 products all at once."""
    raw, ref_w = experts(name)
    ref_w = np.stack(ref_w)  # [n_expert, rows, cols]
    rng = np.random.default_rng(5)
    act = 0.0 if name == "F32" else 1.0 / 254.0
    for n_tok in range(1, 68):
        k = 1 + n_tok % N_EXPERT
        ids = picks(rng, n_tok, k)
        x = rng.standard_normal((n_tok, 1, COLS)).astype(np.float32)
        y = ops.mul_mat_id(raw, name, N_EXPERT, ROWS, COLS, x, ids)
        w = ref_w[ids]  # [n_tok, k, rows, cols]
        x64 = x[:, 0].astype(np.float64)
        ref = np.einsum("tkrc,tc->tkr", w, x64)
        mag = np.einsum("tkrc,tc->tkr", np.abs(w), np.abs(x64))
        bound = act * np.abs(w).sum(-1) * np.abs(x64).max(-1)[:, None, None] + 1e-5 * mag + 1e-30
        assert np.all(np.abs(y - ref) <= bound), (name, n_tok, k)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "IQ4_NL", "MXFP4", "Q4_K", "Q5_K", "Q6_K"])
def test_mul_mat_id_token_result_independent_of_batch(name, isa, restore_isa):
    """A token's expert products are bit-identical alone and among 2..23 others (expert groups
    of every size the row kernels take, with their regrouped activations): a request's text
    under continuous batching does not depend on its neighbours."""
    if isa not in ops.cpu_info()["supported"]:
        pytest.skip(f"this CPU/OS cannot run the {isa} path")
    ops.set_isa(isa)
    raw, _ = experts(name)
    rng = np.random.default_rng(13)
    k = 2
    ids = picks(rng, 23, k)
    x = rng.standard_normal((23, 1, COLS)).astype(np.float32)
    alone = np.stack([ops.mul_mat_id(raw, name, N_EXPERT, ROWS, COLS, x[t:t + 1], ids[t:t + 1])[0] for t in range(23)])
    for n in range(2, 24):
        y = ops.mul_mat_id(raw, name, N_EXPERT, ROWS, COLS, x[:n], ids[:n])
        np.testing.assert_array_equal(y, alone[:n], err_msg=f"{name} {isa}: {n} tokens")


def test_mul_mat_id_repeated_expert():
    """A token may name one expert in several slots (e.g. experts split over two stacks): every
    slot still gets its product, also when the repeats make one expert's group longer than the
    token count."""
    raw, ref_w = experts("Q8_0")
    rng = np.random.default_rng(9)
    n_tok, k = 30, 4
    ids = np.zeros((n_tok, k), np.int32)
    ids[:, 1:3] = 3
    ids[:, 3] = rng.integers(0, N_EXPERT, n_tok)
    x = rng.standard_normal((n_tok, k, COLS)).astype(np.float32)
    check("Q8_0", ops.mul_mat_id(raw, "Q8_0", N_EXPERT, ROWS, COLS, x, ids), ref_w, x, ids)


def test_an_expert_held_elsewhere_gives_a_zero_row():
    """Id -1 (tensor parallelism: the expert lives on another shard): that slot's row is zero and
    the others are what they are without it."""
    raw, ref_w = experts("Q8_0")
    rng = np.random.default_rng(3)
    n_tok, k = 30, 2
    ids = rng.integers(0, N_EXPERT, (n_tok, k)).astype(np.int32)
    x = rng.standard_normal((n_tok, COLS)).astype(np.float32)
    full = ops.mul_mat_id(raw, "Q8_0", N_EXPERT, ROWS, COLS, x, ids)
    holes = ids.copy()
    holes[::3, 0] = -1
    got = ops.mul_mat_id(raw, "Q8_0", N_EXPERT, ROWS, COLS, x, holes)
    assert np.all(got[::3, 0] == 0)
    keep = holes >= 0
    np.testing.assert_array_equal(got[keep], full[keep])


def test_mul_mat_id_errors():
    raw, _ = experts("Q4_0")
    x = np.zeros((2, COLS), np.float32)
    with pytest.raises(ValueError, match="expert id 6"):
        ops.mul_mat_id(raw, "Q4_0", N_EXPERT, ROWS, COLS, x, [[0], [6]])
    with pytest.raises(ValueError, match="expert id -2"):
        ops.mul_mat_id(raw, "Q4_0", N_EXPERT, ROWS, COLS, x, [[-2], [0]])
    with pytest.raises(ValueError, match="bytes"):
        ops.mul_mat_id(raw[:-1], "Q4_0", N_EXPERT, ROWS, COLS, x, [[0], [1]])
    with pytest.raises(ValueError, match="x_rows"):
        ops.mul_mat_id(raw, "Q4_0", N_EXPERT, ROWS, COLS, np.zeros((2, 2, COLS), np.float32), [[0, 1, 2], [0, 1, 2]])


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("name", ["Q4_0", "Q5_0", "Q8_0", "Q4_1", "IQ4_NL", "MXFP4", "Q2_K", "Q3_K", "Q4_K", "Q6_K", "IQ4_XS"])
def test_repacked_experts(name, isa, restore_isa):
    """Experts repacked one by one (a model's expert stacks on an AVX2 or AVX-512 CPU): products within
    the dequantized weights' bound; below R16_ROWS_MAX tokens (256) an expert's slot has the bits of
    that expert's repacked dense product of the token alone, whatever the batch (a group of 40 too,
    past the other weights' batched bound); a group of R16_ROWS_MAX has the GGUF layout's batched
    bits (its panels unpack the rows)."""
    from stowlm import _core

    big = _core.ops.R16_ROWS_MAX
    if isa not in ops.cpu_info()["supported"]:
        pytest.skip(f"this CPU/OS cannot run the {isa} path")
    ops.set_isa(isa)
    raw, ref_w = experts(name)
    rb = len(raw) // N_EXPERT
    packed = np.concatenate([ops.repack_rows16(raw[e * rb:(e + 1) * rb].reshape(ROWS, -1), name, ROWS, COLS)
                             for e in range(N_EXPERT)])
    rng = np.random.default_rng(17)
    x = rng.standard_normal((23, 1, COLS)).astype(np.float32)
    ids = picks(rng, 23, 3)
    alone = np.stack([ops.mul_mat_id(packed, name, N_EXPERT, ROWS, COLS, x[t:t + 1], ids[t:t + 1], rows16=True)[0]
                      for t in range(23)])
    check(name, alone, ref_w, x, ids)
    for t in (0, 9, 22):
        for j in range(3):
            e = ids[t, j]
            dense = ops.matmul(packed[e * rb:(e + 1) * rb], name, x[t, 0][None, :], rows=ROWS, cols=COLS, rows16=True)
            np.testing.assert_array_equal(alone[t, j], dense[0], err_msg=f"{name} {isa} token {t} slot {j}")
    for n in (2, 7, 23):
        y = ops.mul_mat_id(packed, name, N_EXPERT, ROWS, COLS, x[:n], ids[:n], rows16=True, threads=2)
        np.testing.assert_array_equal(y, alone[:n], err_msg=f"{name} {isa}: {n} tokens")
    xs = rng.standard_normal((big, 1, COLS)).astype(np.float32)
    alone4 = np.stack([ops.matmul(packed[4 * rb:5 * rb], name, xs[t, 0][None, :], rows=ROWS, cols=COLS,
                                  rows16=True)[0] for t in range(big)])[:, None]
    for n in (40, big):  # one expert's group: the row kernels, then the batched ones (scalar: none)
        one = np.full((n, 1), 4, np.int32)
        rows_only = isa == "scalar" or (isa == "avx2" and name in ("Q8_0", "IQ4_NL", "IQ4_XS"))  # no AVX2 GEMM for them
        want = alone4[:n] if rows_only or n < big else ops.mul_mat_id(raw, name, N_EXPERT, ROWS, COLS, xs, one)
        np.testing.assert_array_equal(ops.mul_mat_id(packed, name, N_EXPERT, ROWS, COLS, xs[:n], one, rows16=True),
                                      want, err_msg=f"{name} {isa}: a group of {n}")
