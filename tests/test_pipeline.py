"""Pipeline parallelism: with the layers split over devices, consecutive micro-batches run on
different devices at once. The logits and the KV cache must be bit for bit those of the same
split with the devices taking turns (n_copies=1), and the copies it keeps must be counted."""
import logging

import numpy as np
import pytest

import stowlm
from conftest import DENSE_MODELS, MOE_MODELS, load_fixture
from stowlm.engine import layer_devices, plan

MODELS = DENSE_MODELS + MOE_MODELS
EXPERTS = r"blk\.[0-9]+\.ffn_.*_exps="


def prompt(name, n=96):
    """A fixture prompt repeated to n tokens: several micro-batches of 16-32 tokens."""
    ids = next(r for r in load_fixture(name) if r["kind"] == "logits")["ids"]
    return (ids * (n // len(ids) + 1))[:n]


def run(path, devices, split, n_copies, ids, overrides=None, n_ubatch=16, interleave=None):
    model = stowlm.Model(path, devices=devices, layer_split=split, n_copies=n_copies, tensor_overrides=overrides,
                         interleave=interleave)
    ctx = stowlm.Context(model, n_ctx=256, n_ubatch=n_ubatch, n_outputs=n_ubatch)
    logits = ctx.eval(ids, logits="all")
    last = ctx.eval(ids[:3], logits="last")  # a decode-sized step after the prompt, same slots
    kv = [(ctx._c.kv_bytes(il, False), ctx._c.kv_bytes(il, True)) for il in range(model.n_layer)]
    report = ctx.memory_report()
    projected = plan(path, devices, split, n_ctx=256, n_ubatch=n_ubatch, n_outputs=n_ubatch,
                     tensor_overrides=overrides, n_copies=n_copies, interleave=interleave)
    for r, p in zip(report, projected):
        assert r["allocated"] == r["total"] == p["total"], (r, p)
    assert ctx._c.check_plan() == ""
    return logits, last, kv, ctx


def splits(n_layer, n_dev):
    return [n_layer * (d + 1) // n_dev - n_layer * d // n_dev for d in range(n_dev)]


@pytest.mark.parametrize("name", MODELS)
def test_pipelined_equals_taking_turns(model_path, name):
    path = model_path(name)
    ids = prompt(name)
    n_layer = stowlm.Model(path).n_layer
    for n_dev, interleave in ((2, 1), (2, None), (3, None), (4, 1)):  # None: the default, 2 where it can
        devices = [f"cpu:{d}[threads=1]" for d in range(n_dev)]
        split = splits(n_layer, n_dev)
        turns = run(path, devices, split, 1, ids, interleave=interleave)
        piped = run(path, devices, split, 4, ids, interleave=interleave)
        assert turns[3].pipeline == {"n_copies": 1, "reason": "n_copies is 1"}
        assert piped[3].pipeline == {"n_copies": 4, "reason": ""}, piped[3].pipeline
        stats = piped[3].pipeline_stats
        assert stats["micro_batches"] == len(ids) // 16 and len(stats["busy_s"]) == n_dev
        np.testing.assert_array_equal(piped[0], turns[0], err_msg=f"{name} over {n_dev} devices")
        np.testing.assert_array_equal(piped[1], turns[1])
        assert piped[2] == turns[2], f"{name}: KV cache differs over {n_dev} devices"
        # Only the crossing tensors are kept 4 times: the copies grow 4x, nothing else.
        for a, b in zip(turns[3].memory_report(), piped[3].memory_report()):
            assert b["copies"] == 4 * a["copies"] or a["copies"] == b["copies"] == 0
            # (the arena packs the rest again without the copies: greedy packing may differ a little)
            assert b["compute"] - b["copies"] <= 1.1 * a["compute"] + 65536, (a, b)


def test_interleaved_layers_give_the_same_bits_as_contiguous_ones(model_path):
    """Each device's layers in two ranges that take turns: other layers on each device, the same
    arithmetic, so the same logits and KV cache; the core and Python agree on where each layer is."""
    path = model_path("smollm2-135m")
    ids = prompt("smollm2-135m")
    devices = ["cpu:0[threads=1]", "cpu:1[threads=1]", "cpu:2[threads=1]"]
    one = run(path, devices, [10, 12, 8], 4, ids, interleave=1)
    two = run(path, devices, [10, 12, 8], 4, ids)
    assert one[3].model.layer_devices == [0] * 10 + [1] * 12 + [2] * 8
    assert two[3].model.interleave == 2
    assert two[3].model.layer_devices == [0] * 5 + [1] * 6 + [2] * 4 + [0] * 5 + [1] * 6 + [2] * 4
    assert two[3].model.layer_devices == layer_devices([10, 12, 8])[0]
    np.testing.assert_array_equal(two[0], one[0])
    np.testing.assert_array_equal(two[1], one[1])
    assert two[2] == one[2]
    # each crossing of the pipeline has its copies: 5 boundaries instead of 2
    assert sum(r["copies"] for r in two[3].memory_report()) > sum(r["copies"] for r in one[3].memory_report())


def test_interleave_rule():
    assert layer_devices([15, 15]) == ([0] * 7 + [1] * 7 + [0] * 8 + [1] * 8, 2)
    assert layer_devices([15, 15], 1) == ([0] * 15 + [1] * 15, 1)
    assert layer_devices([29, 1]) == ([0] * 29 + [1], 1)  # a device with one layer: one range each
    assert layer_devices([4, 2], 3)[1] == 2               # at most a holding device's layer count
    assert layer_devices([30, 0]) == ([0] * 30, 1)        # one device computes everything
    assert layer_devices([0, 6, 6], 3) == ([1, 1, 2, 2] * 3, 3)
    # a GPU among them: one range each unless asked (each range costs it a sync per token)
    assert layer_devices([15, 15], None, cpu_only=False)[1] == 1
    assert layer_devices([15, 15], 2, cpu_only=False)[1] == 2
    with pytest.raises(ValueError, match="interleave must be a positive integer"):
        layer_devices([15, 15], 0)


@pytest.mark.parametrize("name", MOE_MODELS)
def test_pipelined_with_experts_on_another_device(model_path, name):
    """Experts on cpu:2 while the layers are split over cpu:0 and cpu:1: the same bits as the
    devices taking turns, whether the pipeline runs or says why it cannot."""
    path = model_path(name)
    ids = prompt(name, 64)
    n_layer = stowlm.Model(path).n_layer
    devices = ["cpu:0[threads=1]", "cpu:1[threads=1]", "cpu:2[threads=1]"]
    split = splits(n_layer, 2) + [0]
    overrides = [EXPERTS + "cpu:2"]
    turns = run(path, devices, split, 1, ids, overrides)
    piped = run(path, devices, split, 4, ids, overrides)
    print(f"\n{name}, experts on cpu:2: {piped[3].pipeline}")
    np.testing.assert_array_equal(piped[0], turns[0])
    assert piped[2] == turns[2]
    mode = piped[3].pipeline
    assert mode["n_copies"] == 4 or "keeps" in mode["reason"], mode


def test_a_device_that_keeps_tensors_between_its_splits_is_not_pipelined(model_path):
    """attn_output of every layer on cpu:1 while cpu:1 also keeps the embedded tokens (smollm2
    ties them to its output head) for layer 0's residual: pipelining would need cpu:1's compute
    buffer once per micro-batch in flight, so it is off, saying why, and nothing extra is planned."""
    path = model_path("smollm2-135m")
    ids = prompt("smollm2-135m", 64)
    devices = ["cpu:0[threads=1]", "cpu:1[threads=1]"]
    turns = run(path, devices, [15, 15], 1, ids, ["attn_output=cpu:1"])
    piped = run(path, devices, [15, 15], 4, ids, ["attn_output=cpu:1"])
    np.testing.assert_array_equal(piped[0], turns[0])
    mode = piped[3].pipeline
    assert mode["n_copies"] == 1 and "cpu:1 keeps" in mode["reason"] and "tensor overrides" in mode["reason"], mode
    assert [r["total"] for r in piped[3].memory_report()] == [r["total"] for r in turns[3].memory_report()]


def test_experts_alone_on_another_device_are_pipelined(model_path):
    """Every layer on cpu:0, the experts on cpu:1 (a GPU with its experts in host RAM): the
    attention of one micro-batch overlaps the experts of the one before."""
    path = model_path("qwen3moe-tiny")
    ids = prompt("qwen3moe-tiny", 64)
    devices = ["cpu:0[threads=1]", "cpu:1[threads=1]"]
    turns = run(path, devices, [4, 0], 1, ids, [EXPERTS + "cpu:1"])
    piped = run(path, devices, [4, 0], 4, ids, [EXPERTS + "cpu:1"])
    assert piped[3].pipeline == {"n_copies": 4, "reason": ""}
    np.testing.assert_array_equal(piped[0], turns[0])
    assert piped[2] == turns[2]


def test_one_device_is_not_pipelined(model_path):
    path = model_path("smollm2-135m")
    model = stowlm.Model(path, devices=["cpu:0[threads=1]", "cpu:1[threads=1]"], layer_split=[30, 0])
    ctx = stowlm.Context(model, n_ctx=128, n_ubatch=16)
    assert ctx.pipeline == {"n_copies": 1, "reason": "one device computes everything"}


def test_copies_that_do_not_fit_retry_with_one(model_path, caplog):
    """A budget that holds the split with one copy but not with four: the context frees what the
    four-copy attempt allocated, plans one copy, says so, and allocates exactly that."""
    path = model_path("smollm2-135m")
    devices = ["cpu:0[threads=1]", "cpu:1[threads=1]"]
    one = plan(path, devices, [15, 15], n_ctx=256, n_ubatch=64, n_outputs=1, n_copies=1)
    four = plan(path, devices, [15, 15], n_ctx=256, n_ubatch=64, n_outputs=1, n_copies=4)
    assert four[1]["total"] > one[1]["total"]
    tight = ["cpu:0[threads=1]", f"cpu:1[threads=1,mem={one[1]['total']}]"]
    model = stowlm.Model(path, devices=tight, layer_split=[15, 15])
    before = model._m.device_used()
    with caplog.at_level(logging.WARNING, logger="stowlm"):
        ctx = stowlm.Context(model, n_ctx=256, n_ubatch=64, n_outputs=1)
    assert ctx.pipeline["n_copies"] == 1 and "retried with 1 copy" in ctx.pipeline["reason"]
    assert "pipeline parallelism off" in caplog.text and "cpu:1" in caplog.text
    report = ctx.memory_report()
    assert [r["allocated"] for r in report] == [r["total"] for r in one]
    assert report[1]["allocated"] - before[1] == one[1]["kv"] + one[1]["compute"]
    ids = prompt("smollm2-135m", 200)
    ref = stowlm.Context(stowlm.Model(path, devices=devices, layer_split=[15, 15]), n_ctx=256, n_ubatch=64,
                         n_outputs=1).eval(ids)
    np.testing.assert_array_equal(ctx.eval(ids), ref)
    del ctx
    assert model._m.device_used() == before  # everything of the context is returned


def test_n_copies_is_checked(model_path):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="n_copies must be a positive integer"):
            stowlm.Model(model_path("smollm2-135m"), n_copies=bad)
