"""Mixture-of-experts models (llama with experts, qwen3moe) against llama.cpp's recorded logits,
with the experts on the layer's device and on another virtual device, and the planner's
projection against what a context allocates."""
import numpy as np
import pytest

import stowlm
from conftest import load_fixture
from float_reference import FloatModel
from stowlm.engine import plan

EXPERTS = r"blk\.[0-9]+\.ffn_.*_exps=cpu:1"
ONE = ["cpu:0[threads=2]"]
TWO = ["cpu:0[threads=1]", "cpu:1[threads=1]"]


def figures(model, records):
    """Mean KL(P_ref || P_ours) over the reference's top 40 and top-1 agreement, all positions."""
    kls, top1 = [], []
    for r in records:
        logits = stowlm.Context(model, n_ctx=128).eval(r["ids"], logits="all").astype(np.float64)
        for row, p in zip(logits, r["positions"]):
            lse = np.log(np.exp(row - row.max()).sum()) + row.max()
            ref = np.array(p["logits"]) - p["lse"]
            kls.append(float((np.exp(ref) * (ref - (row[p["ids"]] - lse))).sum()))
            top1.append(int(np.argmax(row)) == p["ids"][0])
    return float(np.mean(kls)), float(np.mean(top1)), kls


def logit_records(name):
    return [r for r in load_fixture(name) if r["kind"] == "logits"]


def test_qwen3moe_matches_llama_cpp(model_path):
    model = stowlm.Model(model_path("qwen3moe-tiny"), devices=ONE)
    assert model.arch == "qwen3moe"
    kl, top1, _ = figures(model, logit_records("qwen3moe-tiny"))
    print(f"\nqwen3moe-tiny: mean KL {kl:.5f}, top-1 {top1:.1%}")
    assert kl < 0.01 and top1 >= 0.95


def test_smollm2_moe_matches_llama_cpp(model_path):
    """smollm2-moe stores each expert as a mirror pair with negated router rows, so a rounding
    flip at the 4th/5th expert only swaps identical twins: every position can be compared. The
    top-1 token may differ only where llama.cpp's own two best are within 0.5 of a logit (both
    sides quantize activations to 8 bits: the AVX2 path flips 5 of 84 such near-ties, whose
    margins are 0.07-0.36, the scalar one 4); a routing error moves far more than that."""
    model = stowlm.Model(model_path("smollm2-moe"), devices=ONE)
    records = logit_records("smollm2-moe")
    kl, top1, _ = figures(model, records)
    print(f"\nsmollm2-moe: mean KL {kl:.5f}, top-1 {top1:.1%}")
    flips = []
    for r in records:
        logits = stowlm.Context(model, n_ctx=128).eval(r["ids"], logits="all")
        for row, p in zip(logits, r["positions"]):
            if int(np.argmax(row)) != p["ids"][0]:
                flips.append((int(np.argmax(row)) == p["ids"][1], p["logits"][0] - p["logits"][1]))
    assert kl < 0.01 and top1 >= 0.9
    assert all(second and margin < 0.5 for second, margin in flips), flips


@pytest.mark.parametrize("name", ["smollm2-moe", "qwen3moe-tiny"])
def test_experts_on_another_device(model_path, name):
    """The experts on cpu:1 while every layer is on cpu:0: the expert weights move, the logits
    stay the same (bit for bit: the same kernels on the same rows), and the planner's projection
    is what the context allocates, with and without the override."""
    path = model_path(name)
    ids = [r for r in logit_records(name)][2]["ids"]
    n_ctx, n_ubatch = 64, 16
    base = stowlm.Model(path, devices=TWO, layer_split=None)
    n_layer = base.n_layer
    split = [n_layer, 0]
    results = {}
    for overrides in ([], [EXPERTS]):
        projected = plan(path, TWO, layer_split=split, n_ctx=n_ctx, n_ubatch=n_ubatch, tensor_overrides=overrides)
        model = stowlm.Model(path, devices=TWO, layer_split=split, tensor_overrides=overrides)
        assert model.plan(n_ctx, n_ubatch, "f16") == projected
        ctx = stowlm.Context(model, n_ctx=n_ctx, n_ubatch=n_ubatch)
        report = ctx.memory_report()
        for p, r in zip(projected, report):
            assert r["allocated"] == r["total"] == p["total"], (p, r)
        assert ctx._c.check_plan() == ""
        results[bool(overrides)] = (ctx.eval(ids, logits="all"), report, model)
    same, moved = results[False], results[True]
    np.testing.assert_array_equal(moved[0], same[0])
    model = moved[2]
    assert model.tensor_device("blk.0.ffn_up_exps.weight") == 1
    assert model.tensor_device("blk.0.ffn_gate_inp.weight") == 0
    assert model.tensor_device("blk.0.attn_q.weight") == 0
    assert same[1][1]["weights"] == 0 and moved[1][1]["weights"] > 0
    assert moved[1][0]["weights"] + moved[1][1]["weights"] == same[1][0]["weights"]
    # Activations cross to cpu:1 and back every layer. Per layer cpu:1 receives the normed hidden
    # state, the expert ids and routing weights (k per token) and the residual stream; cpu:0 gets
    # the layer's output back (the last one as the rows the output head wants).
    with stowlm.GGUFFile(path) as f:
        k = int(f.metadata[f"{model.arch}.expert_used_count"])
    # Kept once per micro-batch in flight: cpu:0 attends to micro-batch i while cpu:1 runs the
    # experts of micro-batch i-1 (pipeline parallelism, test_pipeline.py).
    E, n, slots = model.n_embd, n_ubatch, model.n_copies
    assert moved[1][1]["copies"] == slots * n_layer * (2 * E * n * 4 + 2 * k * n * 4)
    assert moved[1][0]["copies"] == slots * n_layer * E * n * 4
    assert same[1][1]["copies"] == same[1][0]["copies"] == 0


def test_tensor_override_errors(model_path):
    path = model_path("qwen3moe-tiny")
    # A search, not a whole-name match; the first matching entry wins.
    model = stowlm.Model(path, devices=TWO, layer_split=[4, 0],
                         tensor_overrides=[r"up_exps=cpu:0", r"_exps=cpu:1", r"^blk\.1\.=cpu:1"])
    assert [model.tensor_device(f"blk.0.ffn_{n}_exps.weight") for n in ("up", "gate", "down")] == [0, 1, 1]
    assert model.tensor_device("blk.1.attn_q.weight") == 1 and model.tensor_device("blk.2.attn_q.weight") == 0
    with pytest.raises(ValueError, match=r"'cpu:7' is not one of \['cpu:0', 'cpu:1'\]"):
        stowlm.Model(path, devices=TWO, tensor_overrides=[r"ffn_.*_exps=cpu:7"])
    with pytest.raises(ValueError, match="REGEX=DEVICE"):
        stowlm.Model(path, devices=TWO, tensor_overrides=["ffn_up_exps"])
    with pytest.raises(ValueError, match="regular expression"):
        stowlm.Model(path, devices=TWO, tensor_overrides=["ffn_(up=cpu:1"])
    # Character classes and alternations are Python's regular expressions (the core gets the names
    # they match, escaped: no bracket expression reaches std::regex, whose locale lookups crash
    # when another library brought its own C++ runtime first, as jaxlib does on the GPU machines).
    from stowlm.engine import _tensor_overrides, tensor_names
    spec = r"blk\.[0-2]\.ffn_(up|down)_exps=cpu:1"
    native = _tensor_overrides([spec], stowlm.devices.parse_devices(TWO), tensor_names(path))
    assert "[" not in native[0][0] and native[0][2] == spec
    model = stowlm.Model(path, devices=TWO, layer_split=[4, 0], tensor_overrides=[spec])
    assert [model.tensor_device(f"blk.{i}.ffn_{n}_exps.weight") for i in (0, 2, 3) for n in ("up", "down", "gate")] \
        == [1, 1, 0, 1, 1, 0, 0, 0, 0]
    assert model.plan(256, 64, "f16") == stowlm.engine.plan(path, TWO, [4, 0], n_ctx=256, n_ubatch=64,
                                                             tensor_overrides=[spec])
    with pytest.raises(Exception, match="matches no tensor"):  # a pattern no name matches is still reported
        stowlm.Model(path, devices=TWO, tensor_overrides=[r"blk\.[7-9]\.ffn_up_exps=cpu:1"])


# ---- tiny synthetic MoE models against the float64 numpy forward pass of float_reference.py -

S_EMBD, S_HEAD, S_HEAD_KV, S_VOCAB, S_LAYER, S_EXPERT, S_USED, S_FF, S_SHFF = 64, 4, 2, 200, 3, 5, 2, 48, 80
S_EPS, S_BASE = 1e-6, 10000.0


def make_moe(path, arch, seed=1):
    import gguf

    rng = np.random.default_rng(seed)

    def rnd(*shape, s=0.2):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    hd = S_EMBD // S_HEAD
    w = gguf.GGUFWriter(str(path), arch)
    for key, val in [("embedding_length", S_EMBD), ("block_count", S_LAYER), ("attention.head_count", S_HEAD),
                     ("attention.head_count_kv", S_HEAD_KV), ("feed_forward_length", S_FF),
                     ("context_length", 256), ("expert_count", S_EXPERT), ("expert_used_count", S_USED)]:
        w.add_uint32(f"{arch}.{key}", val)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", S_EPS)
    w.add_float32(f"{arch}.rope.freq_base", S_BASE)
    T = {"token_embd.weight": rnd(S_VOCAB, S_EMBD, s=1.0), "output_norm.weight": 1 + rnd(S_EMBD, s=0.1),
         "output.weight": rnd(S_VOCAB, S_EMBD)}
    for il in range(S_LAYER):
        p = f"blk.{il}."
        T[p + "attn_norm.weight"] = 1 + rnd(S_EMBD, s=0.1)
        T[p + "attn_q.weight"] = rnd(S_HEAD * hd, S_EMBD)
        T[p + "attn_k.weight"] = rnd(S_HEAD_KV * hd, S_EMBD)
        T[p + "attn_v.weight"] = rnd(S_HEAD_KV * hd, S_EMBD)
        T[p + "attn_output.weight"] = rnd(S_EMBD, S_HEAD * hd)
        T[p + "ffn_norm.weight"] = 1 + rnd(S_EMBD, s=0.1)
        T[p + "ffn_gate_inp.weight"] = rnd(S_EXPERT, S_EMBD, s=0.5)
        T[p + "ffn_gate_exps.weight"] = rnd(S_EXPERT, S_FF, S_EMBD)
        T[p + "ffn_up_exps.weight"] = rnd(S_EXPERT, S_FF, S_EMBD)
        T[p + "ffn_down_exps.weight"] = rnd(S_EXPERT, S_EMBD, S_FF)
        if arch == "qwen3moe":
            T[p + "attn_q_norm.weight"] = 1 + rnd(hd, s=0.1)
            T[p + "attn_k_norm.weight"] = 1 + rnd(hd, s=0.1)
        if arch == "qwen2moe":
            for t, n in (("q", S_HEAD), ("k", S_HEAD_KV), ("v", S_HEAD_KV)):
                T[p + f"attn_{t}.bias"] = rnd(n * hd)
            T[p + "ffn_gate_inp_shexp.weight"] = rnd(S_EMBD, s=0.5)
            T[p + "ffn_gate_shexp.weight"] = rnd(S_SHFF, S_EMBD)
            T[p + "ffn_up_shexp.weight"] = rnd(S_SHFF, S_EMBD)
            T[p + "ffn_down_shexp.weight"] = rnd(S_EMBD, S_SHFF)
    for name, arr in T.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return T


def moe_reference(path, ids, **overrides):
    """tests/float_reference.py on the written file (llama.cpp's conventions: softmax over all
    experts, top k, renormalised for llama and qwen3moe, not qwen2moe, whose shared expert is
    gated by sigmoid(gate . x)), K/V rounded to F16 as the cache holds them."""
    return FloatModel(path, **overrides).logits(ids, kv_f16=True)


@pytest.mark.parametrize("arch", ["llama", "qwen3moe", "qwen2moe"])
def test_synthetic_moe_matches_numpy(tmp_path, arch):
    """F32 weights (no quantization anywhere): the engine's MoE wiring against the numpy forward
    pass, in one batch, in micro-batches with token-by-token decoding, and with the experts on
    a second device."""
    path = tmp_path / f"{arch}.gguf"
    make_moe(path, arch)
    ids = [(11 * i + 5) % S_VOCAB for i in range(14)]
    want = moe_reference(path, ids)
    model = stowlm.Model(path, devices=ONE)
    assert model.arch == arch
    got = stowlm.Context(model, n_ctx=32, n_ubatch=16).eval(ids, logits="all")
    err = np.abs(got - want).max() / np.abs(want).max()
    print(f"\n{arch}: max error {err:.1e}")
    assert err < 2e-3
    ctx = stowlm.Context(model, n_ctx=32, n_ubatch=4)
    steps = np.vstack([ctx.eval(ids[:9], logits="all")] + [ctx.eval([t]) for t in ids[9:]])
    assert np.abs(steps - want).max() / np.abs(want).max() < 2e-3
    moved = stowlm.Model(path, devices=TWO, layer_split=[S_LAYER, 0], tensor_overrides=[EXPERTS])
    assert moved.tensor_device("blk.1.ffn_down_exps.weight") == 1
    np.testing.assert_allclose(stowlm.Context(moved, n_ctx=32, n_ubatch=16).eval(ids, logits="all"), got,
                               rtol=1e-5, atol=1e-5)
    # The test can tell the conventions apart: the other normalisation is far from the engine.
    flipped = moe_reference(path, ids, norm_w=arch == "qwen2moe")
    assert np.abs(flipped - got).max() / np.abs(want).max() > 2e-2
