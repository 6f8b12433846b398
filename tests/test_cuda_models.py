"""Whole models on a CUDA device through the engine (cuda/cuda_engine.cpp): dense and MoE logits
against llama.cpp's recorded fixtures, decoding against the CPU engine, a model split between
cpu:0 and cuda:0, and exact memory accounting; gpt-oss, deepseek2 and glm4moe, and contexts of
several sequences (the same bits for a token alone or among others); CUDA graphs on and off give the
same bits. GPU cases skip, printing
why, where stowlm was built without CUDA or no device is present (STOWLM_REQUIRE_GPU=1 makes that
a failure); the errors a CUDA device list gives without a GPU are checked everywhere."""
import numpy as np
import pytest

import stowlm
from conftest import ARCH_MODELS, cuda_skip_reason, load_fixture, require_devices
from stowlm.engine import plan
from test_models import TIE, assert_same_distributions, compare, log_softmax, tie_band
from test_moe import figures, logit_records

CUDA = "cuda:0"
CPU = "cpu:0[threads=1]"
DENSE = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"]
# deepseek2-tiny's experts are 1.5-3 bit i-quants. The GPU quantizes activations in blocks of 32 (as
# llama.cpp's CUDA backend does), the CPU in blocks of 256 (as llama.cpp's CPU backend does), and at
# these bit widths the two roundings move the logits apart more than elsewhere. Each engine stays
# within the fixture's bar of llama.cpp (mean KL 0.0073 on an H100, 0.0060 on the CPU), so the two
# may sit up to twice that bar from each other. Measured on an H100, 2026-11-26: decode mean 0.012,
# max 0.031; four sequences max 0.054; tensor split over cuda:0 + cpu top-1 0.964.
# glm4moe-tiny picks its experts by sigmoid scores plus biases, and its near-tied picks move with
# the engines' roundings: on an H100 beside its AMX host (2026-11-28) decode sat at mean KL 5.2e-3
# (max 1.3e-2) with graphs and fused kernels on or off, and under 5e-3 once attention summed in
# another order, while the GPU stayed within the fixture's bar of llama.cpp (mean KL 0.0038).
LOOSE = {"deepseek2-tiny", "glm4moe-tiny"}


def cpu_gap(name, mean, worst):
    """The KL bars (mean, max) between the CUDA and the CPU engine for this model."""
    return (0.02, 0.1) if name in LOOSE else (mean, worst)


def _kl(a, b):
    """KL(P_a || P_b) of two logit rows."""
    la, lb = log_softmax(a), log_softmax(b)
    return float(np.sum(np.exp(la) * (la - lb)))


def assert_exact_accounting(ctx):
    """What each device handed out is what the planner projected (weights + KV + compute)."""
    report = ctx.memory_report()
    for r in report:
        assert r["allocated"] == r["total"] <= r["budget"], r
    return report


# ---- without a GPU ---------------------------------------------------------------------------

def test_cuda_device_lists_without_a_gpu_are_clear_errors(model_path):
    if cuda_skip_reason() is None:
        pytest.skip("this machine has a CUDA device")
    path = model_path("smollm2-135m")
    for devices in (["cuda:0"], ["cpu:0", "cuda:0"], "cuda:1[mem=1GiB]"):
        with pytest.raises(RuntimeError, match="no CUDA device is present"):
            stowlm.Model(path, devices=devices)
        # The projection needs the device too (its kernels' scratch depends on its SM count).
        with pytest.raises(RuntimeError, match="no CUDA device is present"):
            plan(path, devices=devices, n_ctx=64, n_ubatch=8)
    # Below the Python device parser: the engine's own make_backend names the device and why.
    from stowlm import _core

    with pytest.raises(RuntimeError, match=r"cuda:0.*no CUDA device is present|no CUDA device is present.*cuda:0"):
        _core.engine.Model(str(path), [("cuda", 0, 0, 0, -1)], [], [])
    with pytest.raises(RuntimeError, match="no CUDA device is present"):
        _core.engine.project(str(path), [("cpu", 0, 1, 0, -1), ("cuda", 0, 0, 0, -1)], [], [], 64, 8, "f16", 0, 4)
    assert stowlm.Model(path, devices=[CPU]).n_layer == 30  # the process stays usable


# ---- on a GPU --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", DENSE)
def test_dense_logits_match_llama_cpp_on_cuda(model_path, name):
    """The criteria of test_models.test_logits_match_llama_cpp, on cuda:0 (prompts of more than 8
    tokens: the tiled tensor-core product; the flash attention kernel; F16 KV cells)."""
    require_devices(CUDA)
    model = stowlm.Model(model_path(name), devices=[CUDA])
    ctx = stowlm.Context(model, n_ctx=256, n_ubatch=64)
    assert ctx._c.check_plan() == ""
    gaps, kls, spread = [], [], []
    for r in (r for r in load_fixture(name) if r["kind"] == "logits"):
        ctx.clear()
        g, k, s = compare(ctx.eval(r["ids"], logits="all"), r["positions"])
        gaps += g
        kls += k
        spread += s
    gaps = np.array(gaps)
    strict, near_tie, mean_kl = float(np.mean(gaps == 0)), float(np.mean(gaps < TIE)), float(np.mean(kls))
    print(f"\n{name} on {CUDA}: {len(gaps)} positions, top-1 {100 * strict:.1f}% strict, {100 * near_tie:.1f}% "
          f"counting near-ties, band {tie_band(spread):.3f}, mean KL {mean_kl:.5f}")
    assert len(gaps) >= 60
    # The fixture is llama.cpp's CPU run; the GPU sums in another order, so a top-1 that differs
    # within the noise band between the two (tie_band) says nothing (H100, 2026-11-26: smollm2
    # 96.4% strict, 97.6% within 0.1, mean KL 0.0040 against the CPU engine's 0.0037).
    near_band = float(np.mean(gaps < tie_band(spread)))
    assert near_band >= 0.98 and strict >= 0.95 and mean_kl < 0.01, (near_tie, near_band, strict, mean_kl)
    report = assert_exact_accounting(ctx)
    assert [r["device"] for r in report] == [CUDA]
    assert report[0]["weights"] > 0 and report[0]["kv"] > 0 and report[0]["compute"] > 0


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_decoding_on_cuda_follows_the_cpu(model_path, kv_type):
    """A 300-token prompt, then one token at a time: the decode graphs (vector product kernel,
    split-KV attention once more than 256 cells are visible) give the CPU engine's distributions."""
    require_devices(CUDA)
    path = model_path("smollm2-135m")
    ids = [t for r in load_fixture("smollm2-135m") if r["kind"] == "logits" for t in r["ids"]]
    prompt = (ids * (300 // len(ids) + 1))[:300]
    rows, tokens = {}, []
    for dev in (CPU, CUDA):  # both decode the CPU's greedy tokens
        ctx = stowlm.Context(stowlm.Model(path, devices=[dev]), n_ctx=640, n_ubatch=128, kv_type=kv_type)
        out = [ctx.eval(prompt, logits="last")]
        for step in range(12):
            if dev == CPU:
                tokens.append(int(np.argmax(out[-1])))
            out.append(ctx.eval([tokens[step]]))
        rows[dev] = np.stack(out)
        if dev == CUDA:
            assert_exact_accounting(ctx)
    assert_same_distributions(rows[CUDA], rows[CPU], f"smollm2-135m decode, {kv_type} KV, cuda:0 vs cpu")


@pytest.mark.parametrize("name,devices,split,overrides", [
    ("smollm2-135m", [CUDA], None, None),
    ("smollm2-135m", [CPU, CUDA], [15, 15], None),
    ("qwen3moe-tiny", [CUDA, CPU], "all", [r"ffn_.*_exps=cpu:0"]),
])
def test_cuda_graphs_give_the_bits_of_plain_launches(model_path, monkeypatch, name, devices, split, overrides):
    """A decode step's kernels replayed as a CUDA graph (from a shape's second run on) give the
    logits of the same kernels launched one by one (STOWLM_CUDA_GRAPHS=0), bit for bit, across a
    256-cell bucket (a new shape, a new graph) and with layers or experts on the CPU."""
    require_devices(*devices)
    path = model_path(name)
    if split == "all":
        split = [stowlm.Model(path, devices=[CPU]).n_layer, 0]
    ids = next(r for r in load_fixture(name) if r["kind"] == "logits")["ids"]
    prompt = (ids * (250 // len(ids) + 1))[:250]
    rows, tokens = {}, []
    for graphs in ("0", "1"):  # the backend reads it when the model's devices are made
        monkeypatch.setenv("STOWLM_CUDA_GRAPHS", graphs)
        model = stowlm.Model(path, devices=devices, layer_split=split, tensor_overrides=overrides)
        ctx = stowlm.Context(model, n_ctx=640, n_ubatch=128)
        out = [ctx.eval(prompt, logits="last")]
        for step in range(16):
            if graphs == "0":
                tokens.append(int(np.argmax(out[-1])))
            out.append(ctx.eval([tokens[step]]))
        rows[graphs] = np.stack(out)
    assert np.array_equal(rows["0"], rows["1"]), np.abs(rows["0"] - rows["1"]).max()


def test_qwen3moe_matches_llama_cpp_on_cuda(model_path):
    """The MoE ops on the device: router top-k and weights, the grouped expert products, their sum."""
    require_devices(CUDA)
    model = stowlm.Model(model_path("qwen3moe-tiny"), devices=[CUDA])
    kl, top1, _ = figures(model, logit_records("qwen3moe-tiny"))
    print(f"\nqwen3moe-tiny on {CUDA}: mean KL {kl:.5f}, top-1 {top1:.1%}")
    assert kl < 0.01 and top1 >= 0.95


@pytest.mark.parametrize("name", ARCH_MODELS)
def test_arch_models_match_llama_cpp_on_cuda(model_path, name):
    """test_arch_models' criteria on cuda:0 (mean KL < 0.01, top-1 >= 95% counting llama.cpp's
    near-ties), every node on the device: YaRN rope, sinks and the sliding window (gpt-oss), MLA's
    cont/concat and V read from the K cells (deepseek2), gated biased grouped routing, a softmax
    over the picked, expert biases, the clamped SwiGLU, MXFP4 and i-quant experts; then decoding
    follows the CPU engine."""
    require_devices(CUDA)
    path = model_path(name)
    model = stowlm.Model(path, devices=[CUDA])
    ctx = stowlm.Context(model, n_ctx=256, n_ubatch=64)
    assert ctx._c.check_plan() == ""
    gaps, kls = [], []
    for r in (r for r in load_fixture(name) if r["kind"] == "logits"):
        ctx.clear()
        g, k, _ = compare(ctx.eval(r["ids"], logits="all"), r["positions"])
        gaps += g
        kls += k
    gaps = np.array(gaps)
    near, kl = float(np.mean(gaps < TIE)), float(np.mean(kls))
    print(f"\n{name} on {CUDA}: {len(gaps)} positions, top-1 {100 * near:.1f}% counting near-ties, mean KL {kl:.5f}")
    assert len(gaps) >= 60 and near >= 0.95 and kl < 0.01
    assert_exact_accounting(ctx)
    ids = next(r for r in load_fixture(name) if r["kind"] == "logits")["ids"]
    rows = {}
    for dev in (CPU, CUDA):  # the same tokens on both
        c = stowlm.Context(stowlm.Model(path, devices=[dev]), n_ctx=256, n_ubatch=64)
        out = [c.eval(ids, logits="last")] + [c.eval([t]) for t in ids[:10]]
        rows[dev] = np.stack(out)
    kl = [_kl(a, b) for a, b in zip(rows[CPU], rows[CUDA])]
    print(f"{name} decode, cuda:0 vs cpu: mean KL {np.mean(kl):.2e}, max {np.max(kl):.2e}")
    mean_bar, max_bar = cpu_gap(name, 5e-3, 5e-2)
    assert np.mean(kl) < mean_bar and np.max(kl) < max_bar


@pytest.mark.parametrize("name", ["smollm2-135m", "gptoss-tiny", "deepseek2-tiny"])
def test_a_token_gets_the_same_logits_alone_and_among_other_sequences_on_cuda(model_path, name):
    """test_batching's check on cuda:0: four sequences in one context; the attention kernel's fixed
    KV splits (in blocks of their own for a few tokens, folded in one block otherwise: the same
    bits) and the vector products of a decode batch give a token the same logits alone or among
    the others; and the CPU engine's numbers up to rounding."""
    require_devices(CUDA)
    path = model_path(name)
    rng = np.random.default_rng(1)
    prompts = [list(map(int, rng.integers(10, 5000, n))) for n in (37, 80, 5, 130)]
    results = {}
    for dev in (CUDA, CPU):
        ctx = stowlm.Context(stowlm.Model(path, devices=[dev]), n_ctx=2048, n_seq=4, n_ubatch=64)

        def fill(seqs):
            ctx.clear()
            for s in seqs:
                ctx.eval_batch(prompts[s], [s] * len(prompts[s]))

        fill([0])
        alone = ctx.eval_batch([42], [0])[0]
        fill([3, 1, 0, 2])
        together = ctx.eval_batch([7, 42, 9, 11], [3, 0, 1, 2], rows=[0, 1, 2, 3])
        if dev == CUDA:
            np.testing.assert_array_equal(together[1], alone)
            fill([1, 2])
            ctx.eval_batch(prompts[0], [0] * len(prompts[0]))
            np.testing.assert_array_equal(ctx.eval_batch([42], [0])[0], alone)
            assert_exact_accounting(ctx)
        results[dev] = together
    kl = [_kl(a, b) for a, b in zip(results[CPU], results[CUDA])]
    print(f"\n{name}, 4 sequences, cuda:0 vs cpu: KL {['%.1e' % x for x in kl]}")
    # one token each: rounding noise, bounded like a decode step's worst (smollm2 on an H100: 0.0097)
    assert max(kl) < cpu_gap(name, 5e-3, 5e-2)[1]


@pytest.mark.parametrize("name,devices,split,overrides", [
    ("smollm2-135m", [CPU, CUDA], [15, 15], None),
    ("smollm2-135m", [CUDA, CPU], [10, 20], None),
    # every layer on the GPU, the experts on the CPU: activations cross twice per layer
    ("qwen3moe-tiny", [CUDA, CPU], None, [r"ffn_.*_exps=cpu:0"]),
])
def test_split_between_cpu_and_cuda(model_path, name, devices, split, overrides):
    require_devices(*devices)
    path = model_path(name)
    ids = next(r for r in load_fixture(name) if r["kind"] == "logits")["ids"]
    ref = stowlm.Context(stowlm.Model(path, devices=[CPU]), n_ctx=64, n_ubatch=64).eval(ids, logits="all")
    if split is None:
        n_layer = stowlm.Model(path, devices=[CPU]).n_layer
        split = [n_layer, 0]
    model = stowlm.Model(path, devices=devices, layer_split=split, tensor_overrides=overrides)
    ctx = stowlm.Context(model, n_ctx=64, n_ubatch=64)
    assert ctx._c.check_plan() == ""
    got = ctx.eval(ids, logits="all")
    assert_same_distributions(got, ref, f"{name} on {devices} split {split}")
    report = assert_exact_accounting(ctx)
    assert [r["device"] for r in report] == [d.split("[")[0] for d in devices]
    if overrides:
        assert report[1]["weights"] > 0 and report[1]["copies"] > 0


def test_prompts_stage_ram_experts_on_the_gpu(model_path):
    """Layers on cuda:0, experts on the CPU: prompt micro-batches of >= moe_offload_min tokens
    multiply the experts on cuda:0 (copied in layer by layer), smaller ones and decoding on the
    CPU. The logits follow the CPU engine's either way, cuda:0 allocates exactly its plan (which
    holds the staged experts), and a prompt whose last micro-batch falls below the threshold
    switches plans within one eval."""
    require_devices(CUDA, CPU)
    name = "qwen3moe-tiny"
    path = model_path(name)
    ids = next(r for r in load_fixture(name) if r["kind"] == "logits")["ids"]
    prompt = (ids * (40 // len(ids) + 1))[:40]
    n_layer = stowlm.Model(path, devices=[CPU]).n_layer
    ref = stowlm.Context(stowlm.Model(path, devices=[CPU]), n_ctx=128, n_ubatch=16).eval(prompt, logits="all")
    for offload_min in (0, 8, 12):  # 0: never; 8: every micro-batch (16, 16, 8); 12: not the last
        model = stowlm.Model(path, devices=[CUDA, CPU], layer_split=[n_layer, 0],
                             tensor_overrides=[r"ffn_.*_exps=cpu:0"], moe_offload_min=offload_min)
        ctx = stowlm.Context(model, n_ctx=128, n_ubatch=16)
        assert ctx._c.check_plan() == ""
        got = ctx.eval(prompt, logits="all")
        assert_same_distributions(got, ref, f"{name}, experts on the CPU, moe_offload_min {offload_min}")
        assert_exact_accounting(ctx)


@pytest.mark.parametrize("mode", ["tensor", "tensor-sum"])
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen3moe-tiny", "deepseek2-tiny"])
@pytest.mark.parametrize("devices,shares", [([CUDA, CPU], [1, 1]), ([CPU, CUDA], [3, 1]),
                                            ([CUDA, "cuda:1"], [1, 1]), ([CUDA, CPU, "cuda:1"], [1, 1, 1])])
def test_tensor_split_over_cuda_and_cpu(model_path, name, devices, shares, mode):
    """Tensor parallelism with CUDA shards (the all-gathers' and all-reduces' parts fetched by peer
    copies, uploads and reads back, placed or summed in shard order on each device): the fixture
    prompts give one device's distributions (a CUDA and a CPU shard round differently, so not one
    device's bits), the same bits twice, and exact memory accounting. (Without a GPU,
    tests/test_cuda_tp_emulated.py checks the same plumbing against the CPU split bit for bit.)"""
    from stowlm import _core
    from test_tensor_parallel import _kl

    require_devices(*devices)
    if "cuda:1" in devices and len(_core.cuda.devices()[0]) < 2:
        pytest.skip("needs two CUDA devices")
    path = model_path(name)
    prompts = [r["ids"] for r in load_fixture(name) if r["kind"] == "logits"]
    one = stowlm.Model(path, devices=[CPU])
    model = stowlm.Model(path, devices=devices, split_mode=mode, tensor_split=shares)
    ctx = stowlm.Context(model, n_ctx=256)
    assert ctx._c.check_plan() == ""
    kl, agree = [], []
    for p in prompts:
        ref = stowlm.Context(one, n_ctx=256).eval(p, logits="all")
        ctx.clear()
        got = ctx.eval(p, logits="all")
        ctx.clear()
        assert np.array_equal(ctx.eval(p, logits="all"), got), (name, devices)
        kl += list(_kl(ref, got))
        top = np.sort(ref, -1)
        agree += list((ref.argmax(-1) == got.argmax(-1)) | (top[:, -1] - top[:, -2] < 0.1))
    print(f"{name} {mode} {devices} {shares}: mean KL {np.mean(kl):.2e}, top-1 {np.mean(agree):.3f}")
    kl_bar, top1_bar = (0.02, 0.95) if name in LOOSE and any(d.startswith("cuda") for d in devices) else (0.01, 0.97)
    assert np.mean(kl) < kl_bar and np.mean(agree) >= top1_bar, (name, devices, np.mean(kl), np.mean(agree))
    assert_exact_accounting(ctx)


def test_cuda_budget_refuses_past_it(model_path):
    require_devices(CUDA)
    path = model_path("smollm2-135m")
    with pytest.raises(MemoryError, match="cuda:0"):
        stowlm.Model(path, devices=["cuda:0[mem=16MiB]"])
    model = stowlm.Model(path, devices=["cuda:0[mem=1GiB]"])
    assert model.plan(n_ctx=64, n_ubatch=8)[0]["budget"] == 1 << 30


def test_the_batching_engine_on_cuda_keeps_a_requests_bits(model_path):
    """The CUDA tiled kernel takes a batch from 9 tokens (its batch bound), so the engine's decode
    batches stay at 8 there: 12 slots decoding at once give each request its text alone; and a
    prompt that reuses a cached prefix mid-chunk gets the log-probabilities of a fresh slot."""
    require_devices(CUDA)
    from test_batching import _forget, _logprobs
    with stowlm.LLM(model_path("smollm2-135m"), devices=[CUDA], n_ctx=12 * 256, n_seq=12, progress=False) as llm:
        eng = llm.engine()
        assert eng.bounds == [9] and eng.max_decode == 8
        prompts = [f"Item {i}: the capital of country number {i} is" for i in range(12)]
        together = [c.text for c in llm.generate_batch(prompts, max_tokens=12, temperature=0)]
        assert together == [llm.generate(p, max_tokens=12, temperature=0).text for p in prompts]
        system = llm.tokenize("You are a careful assistant who answers in one short sentence. " * 3)
        a = system + llm.tokenize(" Tell me about cats.", add_special=False)
        b = system + llm.tokenize(" Tell me about dogs, and why they bark at night so often.", add_special=False)
        _forget(llm)
        fresh, _ = _logprobs(eng, b)
        _forget(llm)
        _logprobs(eng, a)
        got, n = _logprobs(eng, b)
        assert got == fresh and n < len(b)
