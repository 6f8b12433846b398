"""The architectures big mixture-of-experts users run, on the tiny test models of
../shared/tools/make_arch_models.py, against llama.cpp's recorded outputs: gpt-oss (sinks,
alternating sliding window, biases, clamped SwiGLU, YaRN, MXFP4 experts), deepseek2 (multi-head
latent attention, YaRN, a dense layer, grouped sigmoid routing with exp_probs_b, shared expert,
IQ1_S/IQ2_XXS/IQ3_XXS experts) and glm4moe (biases, q/k norms, partial rope, sigmoid routing with
bias, shared expert). Their random weights give flat distributions: exact arithmetic itself scores
mean KL 0.004-0.009 against them (../shared/models.md), so the bar is the issue's: mean KL < 0.01,
top-1 >= 95% counting llama.cpp's near-ties, greedy continuations explained by the noise band."""
import numpy as np
import pytest

import stowlm
from conftest import ARCH_MODELS, load_fixture
from stowlm.engine import plan
from test_models import TIE, compare, follow_greedy, tie_band

N_CTX = 256
GREEDY_MIN = 16
EXPERTS = r"blk\.[0-9]+\.ffn_.*_exps=cpu:1"


@pytest.fixture(scope="module", params=ARCH_MODELS)
def loaded(request, model_path):
    return request.param, stowlm.Model(model_path(request.param), devices=["cpu:0[threads=2]"])


@pytest.fixture(scope="module")
def figures(loaded):
    name, model = loaded
    ctx = stowlm.Context(model, n_ctx=N_CTX, n_ubatch=64)
    out = {"gap": [], "kl": [], "spread": [], "logits": []}
    for r in (r for r in load_fixture(name) if r["kind"] == "logits"):
        ctx.clear()
        logits = ctx.eval(r["ids"], logits="all")
        out["logits"].append(logits)
        for key, vals in zip(("gap", "kl", "spread"), compare(logits, r["positions"])):
            out[key] += vals
    return out


def test_logits_match_llama_cpp(loaded, figures):
    name, _ = loaded
    gaps = np.array(figures["gap"])
    strict, near = float(np.mean(gaps == 0)), float(np.mean(gaps < TIE))
    kl = float(np.mean(figures["kl"]))
    print(f"\n{name}: {len(gaps)} positions: top-1 {100 * strict:.1f}% strict, {100 * near:.1f}% counting "
          f"llama.cpp's near-ties (<{TIE}); mean KL {kl:.5f}, max {max(figures['kl']):.5f}")
    assert len(gaps) >= 60
    assert near >= 0.95, f"{name}: top-1 {near:.3f} counting near-ties; llama.cpp's gaps: {sorted(gaps)[-8:]}"
    assert kl < 0.01, f"{name}: mean KL {kl:.5f}"


def test_greedy_matches_llama_cpp(loaded, figures):
    """Token-by-token decoding follows llama.cpp's greedy continuation until a step where our two
    candidates are closer than the noise band measured on the prompts (these flat distributions
    make such ties common: llama.cpp with F16 weights drifts from itself after a few tokens too);
    beyond that band, exact arithmetic decides, as in test_models.py: the float64 forward pass of
    the same file (tests/float_reference.py) over the prompt and llama.cpp's tokens so far must
    prefer our token, or hold the two within the band."""
    name, model = loaded
    band = tie_band(figures["spread"])
    ctx = stowlm.Context(model, n_ctx=N_CTX, n_ubatch=64)
    report = []
    for r in (r for r in load_fixture(name) if r["kind"] == "logits"):
        ctx.clear()
        logits = ctx.eval(r["ids"], logits="last")
        ref = r["greedy"][:GREEDY_MIN]
        report.append(f"matched {follow_greedy(name, model, ctx, logits, r, ref, band, report)}/{len(ref)}")
    print(f"\n{name} greedy (band {band:.3f}): " + "; ".join(report))


@pytest.mark.parametrize("name", ARCH_MODELS)
def test_experts_on_another_device_and_the_plan(model_path, name):
    """The experts on cpu:1: the same logits bit for bit; every device allocates what the planner
    projected, deepseek2's cache as llama.cpp stores it (kv_lora_rank + rope dims per token)."""
    path = model_path(name)
    ids = next(r for r in load_fixture(name) if r["kind"] == "logits")["ids"]
    two = ["cpu:0[threads=1]", "cpu:1[threads=1]"]
    n_layer = stowlm.Model(path).n_layer
    results = []
    for overrides in ([], [EXPERTS]):
        model = stowlm.Model(path, devices=two, layer_split=[n_layer, 0], tensor_overrides=overrides)
        ctx = stowlm.Context(model, n_ctx=128, n_ubatch=16)
        results.append(ctx.eval(ids, logits="all"))
        projected = plan(path, two, [n_layer, 0], n_ctx=128, n_ubatch=16, tensor_overrides=overrides)
        for p, r in zip(projected, ctx.memory_report()):
            assert r["allocated"] == r["total"] == p["total"], (p, r)
        assert ctx._c.check_plan() == ""
    np.testing.assert_array_equal(results[1], results[0])
    if name == "deepseek2-tiny":
        with stowlm.GGUFFile(path) as f:
            m = f.metadata
            row = m["deepseek2.attention.kv_lora_rank"] + m["deepseek2.rope.dimension_count"]
        kv = plan(path, ["cpu:0"], n_ctx=1024)[0]["kv"]
        assert kv == n_layer * 1024 * row * 2  # F16, one row per token, no V cache
