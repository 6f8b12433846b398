"""CPU weights repacked into 16-row groups (csrc/cpu/repack.h): the layout gives the GGUF bytes
back row for row; the products equal the weights dequantized by the `gguf` package times the
8-bit activations (test_matmul's oracle); every token's result has the same bits alone, in any
batch, on the scalar and the AVX-512 paths; models repack what they may and give the logits of
the GGUF layout up to float rounding."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import load_fixture, subprocess_env

pytest.importorskip("gguf")
from test_matmul import check, make_weights, restore_isa, with_outliers  # noqa: E402,F401

from stowlm import ops  # noqa: E402

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]
KTYPES = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"}


def _cols(name, cols):
    """The 32-element shapes for the K formats: 256-element super-blocks, at least one."""
    return max(256, cols // 256 * 256) if name in KTYPES else cols
ISAS = ["scalar", "avx2", "avx512"]
# formats whose values do not fit the AVX2 GEMM's unsigned bytes (matmul_gemm_avx2.cpp): their
# batched passes keep the row kernels there, so a repacked matrix keeps its rows' bits
AVX2_NO_GEMM = {"Q8_0", "IQ4_NL", "IQ4_XS"}


def _weights(name, rows, cols, seed=3):
    return make_weights(name, rows, cols, np.random.default_rng(seed))


@pytest.mark.parametrize("name", TYPES)
def test_repacked_rows_give_the_gguf_bytes_back(name):
    cols = _cols(name, 320) * (2 if name in KTYPES else 1)
    raw, _ = _weights(name, 48, cols)
    packed = ops.repack_rows16(raw, name, 48, cols)
    assert packed.nbytes == raw.nbytes and not np.array_equal(packed, raw.reshape(-1))
    for r in range(48):
        np.testing.assert_array_equal(ops.unrepack_row16(packed, name, 48, cols, r), raw[r], err_msg=f"{name} row {r}")
    # rows after the last whole group keep their bytes
    tail = ops.repack_rows16(raw[:40], name, 40, cols)
    np.testing.assert_array_equal(tail[32 * raw.shape[1]:], raw[32:40].reshape(-1))
    for r in (0, 31, 32, 39):
        np.testing.assert_array_equal(ops.unrepack_row16(tail, name, 40, cols, r), raw[r])
    with pytest.raises(ValueError, match="cannot be repacked"):
        ops.repack_rows16(_weights("IQ2_XXS", 16, 256)[0], "IQ2_XXS", 16, 256)
    with pytest.raises(ValueError, match="cannot be repacked"):
        ops.repack_rows16(raw[:, : raw.shape[1] // 2].copy(), name, 48, cols // 2 + 1)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", TYPES)
def test_repacked_product_equals_the_dequantized_weights(name, isa, restore_isa):
    if isa not in ops.cpu_info()["supported"]:
        pytest.skip(f"this CPU/OS cannot run the {isa} path")
    ops.set_isa(isa)
    rng = np.random.default_rng(7)
    for rows, cols, n_tok in [(16, 32, 1), (48, 320, 3), (64, 288, 9), (32, 512, 40), (16, 96, 8), (32, 768, 5)]:
        cols = _cols(name, cols)
        raw, ref = _weights(name, rows, cols)
        x = with_outliers(rng.standard_normal((n_tok, cols)).astype(np.float32), rng)
        y = ops.matmul(ops.repack_rows16(raw, name, rows, cols), name, x, rows=rows, cols=cols, rows16=True)
        check(name, y.astype(np.float64), ref, x)


@pytest.mark.parametrize("name", TYPES)
def test_repacked_token_bits_do_not_depend_on_batch_isa_or_threads(name, restore_isa):
    """What speculative verification, continuous batching and prefix reuse rely on: below
    R16_ROWS_MAX tokens (256: the repacked rows' row kernels are faster than the GEMM there) a
    token's product is the one it gets alone, whatever its batch, on the scalar reference and on
    the AVX2 and AVX-512 kernels, on one thread or two, also past the other weights' batched bound (24) and
    past a token block (64); from R16_ROWS_MAX tokens, or in a pass forced onto the batched
    kernels, the GEMM runs and gives the GGUF layout's batched bits (its panels unpack the
    repacked rows)."""
    from stowlm import _core

    big = _core.ops.R16_ROWS_MAX
    rng = np.random.default_rng(9)
    rows, cols = 71, _cols(name, 320) * (2 if name in KTYPES else 1)  # 4 groups and a 7-row tail
    raw, _ = _weights(name, rows, cols)
    packed = ops.repack_rows16(raw, name, rows, cols)
    x = with_outliers(rng.standard_normal((big, cols)).astype(np.float32), rng)
    mm = lambda xs, threads=0, batched=False: ops.matmul(packed, name, xs, rows=rows, cols=cols, rows16=True,
                                                         threads=threads, batched=batched)
    ops.set_isa("scalar")
    alone = np.stack([mm(x[t:t + 1])[0] for t in range(big)])
    for isa in ISAS:
        if isa not in ops.cpu_info()["supported"]:
            continue
        ops.set_isa(isa)
        for k in list(range(1, 12)) + [17, 23, 24, 40, 65, big - 1]:
            start = (7 * k) % (big + 1 - k)
            np.testing.assert_array_equal(mm(x[start:start + k], threads=1 + k % 2), alone[start:start + k],
                                          err_msg=f"{name} {isa}: {k} tokens")
        for k, batched in ((40, True), (big, False)):
            rows_only = isa == "scalar" or (isa == "avx2" and name in AVX2_NO_GEMM)
            want = alone[:k] if rows_only else ops.matmul(raw, name, x[:k])
            np.testing.assert_array_equal(mm(x[:k], threads=2, batched=batched), want,
                                          err_msg=f"{name} {isa}: {k} tokens, batched={batched}")
        # any slice of rows (a tensor-parallel shard), repacked on its own: the whole's bits
        for r0, r1 in ((0, 16), (16, 71), (5, 40), (40, 49), (64, 71)):
            part = ops.repack_rows16(raw[r0:r1], name, r1 - r0, cols)
            y = ops.matmul(part, name, x[:9], rows=r1 - r0, cols=cols, rows16=True)
            np.testing.assert_array_equal(y, alone[:9, r0:r1], err_msg=f"{name} {isa}: rows {r0}-{r1}")


def test_repacked_mxfp4_reads_every_exponent_as_the_reference(restore_isa):
    """MXFP4's groups hold E8M0 exponents, not fp16 scales: the AVX2 and AVX-512 kernels turn all
    256 of them (0 and 1 subnormal floats, 255 as 2^127) into the scalar reference's scales, bit
    for bit."""
    rng = np.random.default_rng(11)
    rows, cols = 32, 512  # 512 blocks: every exponent twice
    raw, _ = _weights("MXFP4", rows, cols)
    blocks = raw.reshape(-1, 17)
    blocks[:, 0] = np.arange(blocks.shape[0]) % 256
    packed = ops.repack_rows16(raw, "MXFP4", rows, cols)
    x = rng.standard_normal((3, cols)).astype(np.float32) * 1e-3
    got = {}
    for isa in ISAS:
        if isa not in ops.cpu_info()["supported"]:
            continue
        ops.set_isa(isa)
        got[isa] = ops.matmul(packed, "MXFP4", x, rows=rows, cols=cols, rows16=True)
    if len(got) < 2:
        pytest.skip("this CPU/OS runs only the scalar path")
    for isa, y in got.items():
        np.testing.assert_array_equal(y, got["scalar"], err_msg=isa)
    assert np.isfinite(got["scalar"]).sum() > 0


def test_repacked_and_plain_weights_share_one_multi_product():
    """A layer's q/k/v in one pass with some matrices repacked and some not (a Q6_K v, an odd row
    count): each result is its matrix's own product."""
    rng = np.random.default_rng(4)
    cols = 256
    specs = [("Q5_0", 64, True), ("Q6_K", 32, False), ("Q8_0", 48, True), ("IQ4_NL", 40, True)]
    mx = [("MXFP4", 32, True), ("Q4_0", 48, False), ("MXFP4", 40, False), ("IQ4_NL", 16, True)]
    kspecs = [("Q4_K", 64, True), ("Q6_K", 32, True), ("Q4_K", 40, False), ("Q5_K", 16, True)]
    lowbit = [("Q3_K", 64, True), ("Q2_K", 48, True), ("Q3_K", 40, False), ("Q6_K", 32, True)]
    for group in (specs, kspecs, lowbit, mx):
        ws = [(_weights(n, r, cols, seed=i)[0], n, r, p) for i, (n, r, p) in enumerate(group)]
        args = [(ops.repack_rows16(w, n, r, cols) if p else w.reshape(-1), n, r) for w, n, r, p in ws]
        for n_tok in (1, 5, 30):
            x = rng.standard_normal((n_tok, cols)).astype(np.float32)
            outs = ops._ops.matmul_multi_raw([(w, ops._qtype_id(n), r) for w, n, r in args], cols, x, 0,
                                             [p for *_, p in ws])
            for (w, n, r), (_, _, _, p), y in zip(args, ws, outs):
                np.testing.assert_array_equal(y, ops.matmul(w, n, x, rows=r, cols=cols, rows16=p), err_msg=f"{n} {n_tok}")


_LOGITS = textwrap.dedent("""
    import sys
    import numpy as np
    import stowlm
    m = stowlm.Model(sys.argv[1], devices=["cpu:0[threads=1]"])
    ctx = stowlm.Context(m, n_ctx=64, n_ubatch=16)
    ids = [int(t) for t in sys.argv[3].split(",")]
    prompt = ctx.eval(ids[:-1], logits="all")
    np.save(sys.argv[2], np.concatenate([prompt, ctx.eval(ids[-1:], logits="all")]))  # and a decoding step
    print(len(m.repacked), sum(1 for _ in m.repacked))
""")


def _logits(path, repack, tmp_path, ids):
    out = tmp_path / f"logits_{repack}.npy"
    p = subprocess.run([sys.executable, "-c", _LOGITS, str(path), str(out), ",".join(map(str, ids))], env=subprocess_env(STOWLM_REPACK=repack),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return int(p.stdout.split()[0]), np.load(out)


def _kl(p_logits, q_logits):
    lp = p_logits - np.logaddexp.reduce(p_logits, axis=-1, keepdims=True)
    lq = q_logits - np.logaddexp.reduce(q_logits, axis=-1, keepdims=True)
    return (np.exp(lp) * (lp - lq)).sum(-1)


@pytest.mark.parametrize("name", ["gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b/Q3_K", "gptoss-tiny"])
def test_models_repack_and_keep_their_logits(name, model_path, tmp_path):
    """gemma3 (Q5_0, Q8_0, Q4_K, Q6_K), qwen2.5-coder (Q5_0, Q4_K, Q6_K, a Q8_0 head), the same
    with its ffn_down in Q3_K (stowlm.draftmodel) and gpt-oss (Q8_0, MXFP4 experts, expert by
    expert) repack their matrices on an AVX-512 VNNI CPU, the embedding table only where it is
    the output too (gemma3's tied head; its lookups unpack their rows). The sums run in
    another order, and an ulp moves later 8-bit roundings, so the logits are the GGUF layout's
    within the noise that test_models measures against llama.cpp (there both layouts pass):
    KL 0.01 on average and below 0.05 everywhere (the largest test_models sees between llama.cpp
    and us), the best token mostly the same."""
    if ops.cpu_info()["best"] not in ("avx512", "amx"):
        pytest.skip("repacking is for the AVX-512 VNNI row kernels")
    base = name.split("/")[0]
    path = model_path(base)
    if name.endswith("/Q3_K"):
        from stowlm.draftmodel import make_draft

        path = make_draft(path, tmp_path / "q3.gguf", weight_type="Q3_K", output_type="same")
    ids = [r for r in load_fixture(base) if r["kind"] == "logits"][0]["ids"]  # a real prompt
    n16, packed = _logits(path, "1", tmp_path, ids)
    n0, plain = _logits(path, "0", tmp_path, ids)
    assert n0 == 0 and n16 > 0
    m = stowlm_model(path)
    assert len(m.repacked) == n16
    # qwen's Q8_0 head and its Q5_0 embedding (read by rows only); gemma's head is its embedding
    tied = name == "gemma3-270m"
    assert ("token_embd.weight" in m.repacked) == tied and ("output.weight" in m.repacked) != tied
    assert ("blk.0.ffn_down_exps.weight" if base == "gptoss-tiny" else "blk.0.ffn_down.weight") in m.repacked
    a, b = packed.astype(np.float64), plain.astype(np.float64)
    kl = _kl(b, a)
    assert kl.mean() < 0.01 and kl.max() < 0.05 and np.mean(a.argmax(-1) == b.argmax(-1)) >= 0.8, (kl.max(), a.argmax(-1), b.argmax(-1))


def stowlm_model(path):
    import stowlm

    return stowlm.Model(str(path), devices=["cpu:0[threads=1]"])


def test_a_repacked_model_allocates_what_was_projected(model_path):
    """Repacking moves bytes, it adds none that a device's budget sees: a model fitted onto a CPU
    device with a budget loads repacked with allocated == projected on it, and its context's
    plan is sound."""
    import stowlm
    from stowlm.fit import fit

    if ops.cpu_info()["best"] not in ("avx512", "amx"):
        pytest.skip("repacking is for the AVX-512 VNNI row kernels")
    placement = fit(str(model_path("qwen2.5-coder-0.5b")), ["cpu:0[mem=2GiB,threads=1]"], n_ctx=512)
    m = stowlm.Model(str(model_path("qwen2.5-coder-0.5b")), placement=placement)
    assert len(m.repacked) > 100
    ctx = stowlm.Context(m)
    for d in placement.used_devices:
        r = {x["device"]: x for x in ctx.memory_report()}[d.name]
        assert r["allocated"] == r["total"] == d.projected["total"], (d.name, r, d.projected)
    assert ctx._c.check_plan() == ""
    ids = [r for r in load_fixture("qwen2.5-coder-0.5b") if r["kind"] == "logits"][0]["ids"]
    assert np.isfinite(ctx.eval(ids)).all()
