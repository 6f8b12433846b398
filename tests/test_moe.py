"""Mixture-of-experts models (llama with experts, qwen3moe) against llama.cpp's recorded logits,
with the experts on the layer's device and on another virtual device, and the planner's
projection against what a context allocates."""
import numpy as np
import pytest

import stowlm
from conftest import load_fixture
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


def test_smollm2_moe_first_position_matches_llama_cpp(model_path):
    """smollm2-moe: the first position of every prompt (30 MoE layers, no attention mixing)
    agrees with llama.cpp. Later positions of the recorded fixture disagree with both this
    engine and an independent float64 numpy forward pass of the same file (which agree with each
    other, and which agrees with llama.cpp on dense smollm2-135m): see the strict xfail below."""
    model = stowlm.Model(model_path("smollm2-moe"), devices=ONE)
    records = logit_records("smollm2-moe")
    first = [dict(r, ids=r["ids"][:1], positions=r["positions"][:1]) for r in records]
    kl, top1, _ = figures(model, first)
    print(f"\nsmollm2-moe first positions: mean KL {kl:.5f}, top-1 {top1:.1%}")
    assert kl < 0.01 and top1 == 1.0


@pytest.mark.xfail(strict=True, reason="fixture disagrees with an independent numpy forward pass from position 1")
def test_smollm2_moe_matches_llama_cpp(model_path):
    model = stowlm.Model(model_path("smollm2-moe"), devices=ONE)
    kl, top1, _ = figures(model, logit_records("smollm2-moe"))
    print(f"\nsmollm2-moe: mean KL {kl:.5f}, top-1 {top1:.1%}")
    assert kl < 0.01 and top1 >= 0.95


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
    # Activations cross to cpu:1 and back every layer: both devices stage copies.
    assert moved[1][1]["copies"] > 0 and moved[1][0]["copies"] > 0 and same[1][1]["copies"] == 0


def test_tensor_override_errors(model_path):
    path = model_path("qwen3moe-tiny")
    with pytest.raises(ValueError, match=r"'cpu:7' is not one of \['cpu:0', 'cpu:1'\]"):
        stowlm.Model(path, devices=TWO, tensor_overrides=[r"ffn_.*_exps=cpu:7"])
    with pytest.raises(ValueError, match="REGEX=DEVICE"):
        stowlm.Model(path, devices=TWO, tensor_overrides=["ffn_up_exps"])
    with pytest.raises(ValueError, match="regular expression"):
        stowlm.Model(path, devices=TWO, tensor_overrides=["ffn_(up=cpu:1"])
