"""moe_offload_min (experts kept in RAM, prompts on the GPU): the setting reaches the core from
Model, Context, fit, placements, LLM and the CLI, and is checked. The staging itself needs a GPU
that can copy experts in: tests/native/cuda_engine_emulated.cpp runs it on the emulated device
(the CPU's logits, exact accounting with the staged experts in cuda:0's compute buffer, plans
switching inside one eval); tests/test_cuda_models.py on a GPU. Here, with CPU devices only, no
expert is ever staged: every value gives the same projection and the same logits."""
import json

import numpy as np
import pytest

import stowlm
from stowlm.fit import fit
from stowlm.placement import Placement
from stowlm.placement.rules import DEFAULT_MOE_OFFLOAD_MIN
from test_fit import run_cli

MOE = "qwen3moe-tiny"


def test_the_default_is_the_cores():
    assert DEFAULT_MOE_OFFLOAD_MIN == stowlm._core.engine.DEFAULT_MOE_OFFLOAD_MIN > 0


def test_model_and_context_take_it_and_cpu_devices_never_stage(model_path):
    path = model_path(MOE)
    ids = [1, 5, 9, 200, 7, 3, 11, 42]
    devices = ["cpu:0[threads=1]", "cpu:1[threads=1]"]
    rows, plans = [], []
    for value in (0, 1, 4, None):
        m = stowlm.Model(path, devices=devices, layer_split=[2, 2], moe_offload_min=value)
        assert m.moe_offload_min == (DEFAULT_MOE_OFFLOAD_MIN if value is None else value)
        plans.append(m.plan(n_ctx=64, n_ubatch=8))
        rows.append(stowlm.Context(m, n_ctx=64, n_ubatch=8).eval(ids, logits="all"))
    assert all(p == plans[0] for p in plans)
    assert all(np.array_equal(r, rows[0]) for r in rows)
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="moe_offload_min"):
            stowlm.Model(path, devices=devices, moe_offload_min=bad)


def test_fit_keeps_it_in_the_placement(model_path, tmp_path):
    path = model_path(MOE)
    pl = fit(path, "cpu:0[mem=1GiB]", n_ctx=256, moe_offload_min=64)
    assert pl.moe_offload_min == 64
    again = Placement.from_dict(json.loads(json.dumps(pl.to_dict())))
    assert again.moe_offload_min == 64
    assert stowlm.Model(path, placement=pl).moe_offload_min == 64
    with pytest.raises(ValueError, match="moe_offload_min=8 differs from the placement's"):
        stowlm.Model(path, placement=pl, moe_offload_min=8)
    with pytest.raises(ValueError, match="moe_offload_min"):
        fit(path, placement=pl, moe_offload_min=8)
    # a placement saved before the setting existed loads with the default
    d = pl.to_dict()
    del d["moe_offload_min"]
    assert Placement.from_dict(d).moe_offload_min == DEFAULT_MOE_OFFLOAD_MIN


def test_cli_flag(model_path):
    path = str(model_path(MOE))
    r = run_cli("fit", "-m", path, "--devices", "cpu:0[mem=1GiB]", "-c", "256", "--moe-offload-min", "0", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["moe_offload_min"] == 0
    r = run_cli("fit", "-m", path, "--devices", "cpu:0[mem=1GiB]", "--moe-offload-min", "-3")
    assert r.returncode != 0 and "moe_offload_min" in r.stderr


def test_host_share_is_checked_and_changes_nothing_without_staging(model_path, monkeypatch):
    """STOWLM_MOE_CPU_SHARE (ContextParams::moe_cpu_share: of each staged layer's experts, the
    share the host computes itself while the GPU copies in the rest) must lie in [0, 1), said by
    name; with CPU devices nothing is staged, so any share gives the same plan and logits. The
    split itself runs on the emulated device (tests/native/cuda_engine_emulated.cpp)."""
    path = model_path(MOE)
    ids = [1, 5, 9, 200, 7, 3, 11, 42]
    m = stowlm.Model(path, devices=["cpu:0[threads=1]"], moe_offload_min=4)
    rows, plans = [], []
    for share in ("0", "0.5"):
        monkeypatch.setenv("STOWLM_MOE_CPU_SHARE", share)
        plans.append(m.plan(n_ctx=64, n_ubatch=8))
        rows.append(stowlm.Context(m, n_ctx=64, n_ubatch=8).eval(ids, logits="all"))
    assert plans[0] == plans[1] and np.array_equal(rows[0], rows[1])
    for bad in ("1", "-0.1", "2", "0.3x"):
        monkeypatch.setenv("STOWLM_MOE_CPU_SHARE", bad)
        with pytest.raises(ValueError, match="STOWLM_MOE_CPU_SHARE"):
            stowlm.Context(m, n_ctx=64, n_ubatch=8)
