"""Tensor parallelism: every layer cut over several devices. split_mode="tensor" gathers rows
before and after each output projection, so every product is computed as on one device;
"tensor-sum" sums the devices' partial products (an all-reduce).

Oracles: one device running the same file ("tensor": the same logits bit for bit, prompts and
decoding, every model, 2 to 4 devices, even and uneven; "tensor-sum": F32 synthetic models the
same logits up to float re-association, real quantized models the same top-1 and a KL at the
level of the activation quantization's rounding flips), the float64 reference, the shards'
geometry against the model's shapes, and the planner's projection against what the devices
allocate."""
import numpy as np
import pytest

import stowlm
from conftest import DENSE_MODELS, MOE_MODELS, get_model, load_fixture
from test_model_reference import CASES, make_model, reference
from test_moe import make_moe, moe_reference


def _devs(n):
    return [f"cpu:{i}[threads=1]" for i in range(n)]


def _logsoftmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _kl(ref, got):
    p = _logsoftmax(ref.astype(np.float64))
    return (np.exp(p) * (p - _logsoftmax(got.astype(np.float64)))).sum(-1)


def _tp(path, shares, mode="tensor", **kw):
    return stowlm.Model(path, devices=_devs(len(shares)), split_mode=mode, tensor_split=shares, **kw)


SHARES = ([1, 1], [3, 1], [2, 1, 1], [1, 1, 1, 1])


@pytest.mark.parametrize("arch,tied", CASES + [("llama-moe", False), ("qwen3moe", False), ("qwen2moe", False)])
def test_f32_models_split_like_one_device(tmp_path, arch, tied):
    path = tmp_path / f"{arch}.gguf"
    if arch in ("llama-moe", "qwen3moe", "qwen2moe"):
        make_moe(path, arch.replace("-moe", ""))
        want = lambda ids: moe_reference(path, ids)  # noqa: E731
    else:
        make_model(path, arch, tied)
        want = lambda ids: reference(path, ids)  # noqa: E731
    ids = [1, 5, 9, 150, 7, 3, 11, 42, 8, 100, 6, 2]
    one = stowlm.Context(stowlm.Model(path), n_ctx=64).eval(ids, logits="all")
    ref = want(ids)
    for shares in SHARES:
        exact = stowlm.Context(_tp(path, shares), n_ctx=64, n_ubatch=5).eval(ids, logits="all")
        np.testing.assert_array_equal(exact, one, err_msg=f"{arch} {shares}")
        got = stowlm.Context(_tp(path, shares, "tensor-sum"), n_ctx=64, n_ubatch=5).eval(ids, logits="all")
        # only the order of the sums differs (up to a rounding of the F16 KV cache)
        err = np.abs(got - one).max() / np.abs(one).max()
        assert err < 1e-3, (arch, shares, err)
        assert np.abs(got - ref).max() / np.abs(ref).max() < 2e-3
        assert (got.argmax(-1) == one.argmax(-1)).all()


def _prompts(name):
    return [r["ids"] for r in load_fixture(name) if r["kind"] == "logits"]


@pytest.mark.parametrize("name", DENSE_MODELS + MOE_MODELS)
def test_real_models_split_give_one_devices_bits(name):
    """Every model, 2, 3 and 4 devices, even and uneven: the fixture prompts' logits and those
    of greedy decoding after them are one device's bit for bit (one device with 2 threads; the
    split's devices have 1 each)."""
    path = str(get_model(name))
    one = stowlm.Model(path)

    def run(model, p):
        ctx = stowlm.Context(model, n_ctx=256)
        rows = [ctx.eval(p, logits="all")]
        for _ in range(4):
            rows.append(ctx.eval([int(rows[-1][-1].argmax())])[None])
        return np.concatenate(rows)

    refs = [run(one, p) for p in _prompts(name)]
    for shares in SHARES:
        model = _tp(path, shares)
        for p, ref in zip(_prompts(name), refs):
            np.testing.assert_array_equal(run(model, p), ref, err_msg=f"{name} {shares}")


@pytest.mark.parametrize("name", DENSE_MODELS + MOE_MODELS)
def test_real_models_summing_partial_products(name):
    """split_mode="tensor-sum": top-1 as on one device (near ties aside), KL at the noise level of a
    re-associated sum under 8-bit activations (the level of one device's AVX2 against its
    AVX-512 kernels), and the same split twice gives the same bits."""
    path = str(get_model(name))
    prompts = _prompts(name)
    one = stowlm.Model(path)
    refs = [stowlm.Context(one, n_ctx=256).eval(p, logits="all") for p in prompts]
    for shares in SHARES:
        model = _tp(path, shares, "tensor-sum")
        ctx = stowlm.Context(model, n_ctx=256)
        kl, agree, near = [], [], []
        for p, ref in zip(prompts, refs):
            ctx.clear()
            got = ctx.eval(p, logits="all")
            ctx.clear()
            assert np.array_equal(ctx.eval(p, logits="all"), got), (name, shares)
            kl += list(_kl(ref, got))
            top = np.sort(ref, -1)
            agree += list(ref.argmax(-1) == got.argmax(-1))
            near += list(top[:, -1] - top[:, -2] < 0.1)  # a near tie either way is agreement
        kl, agree, near = np.array(kl), np.array(agree), np.array(near)
        print(f"{name} {shares}: mean KL {kl.mean():.2e}, top-1 {agree.mean():.3f}")
        assert kl.mean() < 0.01, (name, shares, kl.mean())
        assert (agree | near).mean() >= 0.97, (name, shares, agree.mean())


def test_decoding_after_a_prompt_matches_the_prompt_pass():
    path = str(get_model("smollm2-135m"))
    ids = _prompts("smollm2-135m")[0]
    ctx = stowlm.Context(_tp(path, [1, 1], "tensor-sum"), n_ctx=256)
    whole = ctx.eval(ids, logits="all")
    ctx.clear()
    ctx.eval(ids[:5])
    steps = np.stack([ctx.eval([t]) for t in ids[5:]])
    assert (steps.argmax(-1) == whole[5:].argmax(-1)).mean() >= 0.95
    assert _kl(whole[5:], steps).mean() < 0.01


def test_contexts_on_several_threads_at_once_repeat_their_bits():
    """The devices' threads are kept between calls and lent to one call at a time: contexts that
    evaluate at the same time from several Python threads (the GIL is released) get the bits each
    gets alone, whether it had the kept threads or started its own."""
    import concurrent.futures as cf

    path = str(get_model("smollm2-135m"))
    ids = [r["ids"] for r in load_fixture("smollm2-135m") if r["kind"] == "logits"][0]
    model = _tp(path, [1, 1])
    ctxs = [stowlm.Context(model, n_ctx=256) for _ in range(3)]

    def run(ctx):
        ctx.clear()
        return np.concatenate([ctx.eval(ids, logits="all")] + [ctx.eval([t])[None] for t in ids[:8]])

    alone = run(ctxs[0])
    with cf.ThreadPoolExecutor(3) as ex:
        for _ in range(3):
            for got in ex.map(run, ctxs):
                np.testing.assert_array_equal(got, alone)


def test_the_shards_cover_every_layer_once():
    path = str(get_model("qwen3moe-tiny"))
    whole = stowlm.Model(path).shards[0]
    for mode in ("tensor", "tensor-sum"):
        for shares in ([1, 1], [3, 1], [2, 0, 1, 1], [5, 1, 1]):
            shards = _tp(path, shares, mode).shards
            assert [s["device"] for s in shards] == [d for d, s in enumerate(shares) if s > 0]
            assert sum(s["vocab"] for s in shards) == whole["vocab"]
            for il, layer in enumerate(whole["layers"]):
                for key in ("q_heads", "ffn_rows", "expert_rows", "shexp_rows") + (
                        ("embd_rows",) if mode == "tensor" else ("kv_heads",)):
                    assert sum(s["layers"][il][key] for s in shards) == layer[key], (mode, shares, il, key)
                # by query heads: each shard has the KV heads its query heads read
                n_rep, q0 = layer["q_heads"] // layer["kv_heads"], 0
                for s in shards:
                    nq = s["layers"][il]["q_heads"]
                    want = (q0 + nq - 1) // n_rep - q0 // n_rep + 1 if nq else 0
                    assert s["layers"][il]["kv_heads"] == want, (mode, shares, il)
                    q0 += nq
    # 3 KV heads of smollm2 over 2 devices: query heads 5 + 4, the middle KV head on both;
    # summing partial products, whole KV heads with their queries, 2 + 1
    for mode, q, kv in (("tensor", [5, 4], [2, 2]), ("tensor-sum", [6, 3], [2, 1])):
        s = _tp(str(get_model("smollm2-135m")), [1, 1], mode).shards
        assert [x["layers"][0]["kv_heads"] for x in s] == kv and [x["layers"][0]["q_heads"] for x in s] == q
    # the FFN rows and the output projections' rows of n_embd follow the shares (in groups of 16
    # rows; summing partial products, in whole blocks of the down projection, 32 for Q4_1): the
    # devices meet around each projection, so each part is balanced on its own
    for mode in ("tensor", "tensor-sum"):
        for shares, want in (([1, 1], [768, 768]), ([3, 1], [1152, 384])):
            s = _tp(str(get_model("smollm2-135m")), shares, mode).shards
            assert [x["layers"][0]["ffn_rows"] for x in s] == want
            assert [x["layers"][0]["embd_rows"] for x in s] == ([432, 144] if shares == [3, 1] else [288, 288]) \
                if mode == "tensor" else [0, 0]


@pytest.mark.parametrize("mode", ["tensor", "tensor-sum"])
def test_projection_equals_allocation_and_budgets_hold(mode):
    path = str(get_model("smollm2-moe"))
    model = _tp(path, [2, 1], mode)
    planned = model.plan(n_ctx=512, n_ubatch=64)
    ctx = stowlm.Context(model, n_ctx=512, n_ubatch=64)
    report = ctx.memory_report()
    for p, r in zip(planned, report):
        assert p["total"] == r["total"] == r["allocated"], (p, r)
    # (also: no shard's part is overwritten while another may still read it)
    assert ctx._c.check_plan() == ""
    assert planned[0]["weights"] > planned[1]["weights"] > 0
    assert planned == stowlm.engine.plan(path, devices=_devs(2), n_ctx=512, n_ubatch=64, split_mode=mode,
                                         tensor_split=[2, 1])
    # a device too small for its share is named
    with pytest.raises(MemoryError, match="cpu:1"):
        stowlm.Model(path, devices=["cpu:0", "cpu:1[mem=8MiB]"], split_mode="tensor", tensor_split=[1, 1])


def test_bad_tensor_splits_are_refused():
    path = str(get_model("smollm2-135m"))
    with pytest.raises(ValueError, match="3 shares for 2 devices"):
        stowlm.Model(path, devices=_devs(2), split_mode="tensor", tensor_split=[1, 1, 1])
    with pytest.raises(ValueError, match="every share is 0"):
        stowlm.Model(path, devices=_devs(2), split_mode="tensor", tensor_split=[0, 0])
    with pytest.raises(ValueError, match="finite numbers >= 0"):
        stowlm.Model(path, devices=_devs(2), split_mode="tensor", tensor_split=[1, -1])
    with pytest.raises(ValueError, match="not layer_split"):
        stowlm.Model(path, devices=_devs(2), split_mode="tensor", layer_split=[15, 15])
    with pytest.raises(ValueError, match="split_mode"):
        stowlm.Model(path, devices=_devs(2), split_mode="rows")
    with pytest.raises(ValueError, match="needs split_mode='tensor' or 'tensor-sum'"):
        stowlm.Model(path, devices=_devs(2), tensor_split=[1, 1])


def test_fit_picks_shares_from_free_memory_and_they_load(tmp_path):
    from stowlm import fit

    path = str(get_model("qwen3moe-tiny"))
    p = fit.fit(path, "cpu:0[mem=40MiB],cpu:1[mem=80MiB]", split_mode="tensor", max_ctx=2048)
    shares = [d.shard["share"] for d in p.devices]
    assert p.split_mode == "tensor" and shares[1] > shares[0] > 0 and abs(sum(shares) - 1) < 1e-9
    assert "tensor split" in p.table() and "experts" in p.table()
    p.save(tmp_path / "p.json")
    model = stowlm.Model(path, placement=str(tmp_path / "p.json"))
    ctx = stowlm.Context(model)
    for d, r in zip(p.used_devices, ctx.memory_report()):
        assert r["allocated"] == d.projected["total"] <= d.free - d.margin
    # what it cannot split (the whole embedding on the first device, the gathered logits on the
    # last) may force the roomiest device first
    p = fit.fit(path, "cpu:0[mem=15MiB],cpu:1[mem=64MiB]", split_mode="tensor", max_ctx=4096)
    assert [d.name for d in p.used_devices][0] == "cpu:1" and "reordered" in p.explain()
    with pytest.raises(fit.FitError, match="cpu:0 is short"):
        fit.fit(path, "cpu:0[mem=8MiB],cpu:1[mem=8MiB]", split_mode="tensor")
    # shares the user gives are kept
    p = fit.fit(path, "cpu:0,cpu:1", split_mode="tensor", tensor_split=[3, 1], n_ctx=1024)
    assert [round(d.shard["share"], 3) for d in p.devices] == [0.75, 0.25] and p.n_ctx == 1024
    # the summing split: its own projection (column copies, no gathered activations), kept by the
    # saved placement
    q = fit.fit(path, "cpu:0,cpu:1", split_mode="tensor-sum", tensor_split=[3, 1], n_ctx=1024)
    assert q.split_mode == "tensor-sum" and "tensor-sum split" in q.table()
    assert [d.projected["total"] for d in q.devices] != [d.projected["total"] for d in p.devices]
    q.save(tmp_path / "q.json")
    model = stowlm.Model(path, placement=str(tmp_path / "q.json"))
    assert model.split_mode == "tensor-sum"
    for d, r in zip(q.used_devices, stowlm.Context(model).memory_report()):
        assert r["allocated"] == d.projected["total"]


def test_llm_and_cli_take_a_tensor_split():
    import subprocess
    import sys

    from conftest import subprocess_env

    path = str(get_model("smollm2-135m"))
    prompt = "The capital of France is"
    with stowlm.LLM(path, devices=_devs(2), split_mode="tensor", progress=False, n_ctx=512) as llm:
        assert llm.model.split_mode == "tensor"
        got = llm.generate(prompt, max_tokens=8, temperature=0).tokens
    with stowlm.LLM(path, devices=_devs(2), split_mode="tensor-sum", progress=False, n_ctx=512) as llm:
        summed = llm.generate(prompt, max_tokens=8, temperature=0).tokens
    with stowlm.LLM(path, progress=False, n_ctx=512) as one:
        want = one.generate(prompt, max_tokens=8, temperature=0).tokens
        ids = one.tokenize(prompt)
    assert got == want
    # summed partial products: the same greedy tokens up to the first near tie of one device's
    # (the sums round otherwise, so a tie may go either way; smollm2 has one at the 6th token,
    # 0.13 apart)
    logits = stowlm.Context(stowlm.Model(path), n_ctx=512).eval(ids + want, logits="all")[len(ids) - 1:]
    top2 = np.sort(logits, -1)[:, -2:]
    tie = next((i for i in range(len(want)) if top2[i, 1] - top2[i, 0] < 0.25), len(want))
    assert tie >= 3 and summed[:tie] == want[:tie], (summed, want, tie)
    out = subprocess.run([sys.executable, "-m", "stowlm", "run", path, "-p", "The capital of France is", "-n", "8",
                          "--temp", "0", "-q", "--devices", "cpu:0[threads=1],cpu:1[threads=1]", "-sm", "tensor",
                          "-ts", "3,1"], capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("The capital of France is")
    bad = subprocess.run([sys.executable, "-m", "stowlm", "run", path, "-p", "x", "-ts", "1,1"],
                         capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert bad.returncode != 0 and "-sm tensor" in bad.stderr
    out = subprocess.run([sys.executable, "-m", "stowlm", "fit", path, "--devices", "cpu:0,cpu:1", "-sm", "tensor-sum",
                          "-ts", "1,1", "-c", "512"], capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert out.returncode == 0 and "tensor-sum split 50%:50%" in out.stdout, out.stdout + out.stderr


def test_fitting_a_fitted_tensor_placement_gives_it_back(tmp_path):
    """A saved tensor-split placement fits again to itself (it used to be refused: fit took the
    devices and n_ctx from it and then counted them as set twice)."""
    from stowlm import fit

    path = str(get_model("qwen3moe-tiny"))
    for devices, mode in (("cpu:0[mem=40MiB],cpu:1[mem=80MiB]", "tensor"),
                          ("cpu:0[mem=15MiB],cpu:1[mem=64MiB]", "tensor"),  # the roomiest moved first
                          ("cpu:0[mem=40MiB],cpu:1[mem=80MiB]", "tensor-sum")):
        p = fit.fit(path, devices, split_mode=mode, max_ctx=2048)
        p.save(tmp_path / "p.json")
        again = fit.fit(path, placement=tmp_path / "p.json")
        assert again.split_mode == mode and again.n_ctx == p.n_ctx and again.n_seq == p.n_seq
        assert [d.spec for d in again.devices] == [d.spec for d in p.used_devices]
        assert [d.projected for d in again.devices] == [d.projected for d in p.used_devices]
        assert again.tensor_split == pytest.approx(p.tensor_split)
        for a, b in zip(again.devices, p.used_devices):
            assert a.shard["share"] == pytest.approx(b.shard["share"])
            assert {k: v for k, v in a.shard.items() if k != "share"} == \
                {k: v for k, v in b.shard.items() if k != "share"}
    # what the placement fixes may not be given again, and it is for its own model only
    with pytest.raises(ValueError, match="placement fixes"):
        fit.fit(path, "cpu:0,cpu:1", placement=p)
    with pytest.raises(ValueError, match="placement fixes"):
        fit.fit(path, placement=p, n_ctx=512)
    with pytest.raises(ValueError, match="made for another model"):
        fit.fit(str(get_model("smollm2-moe")), placement=p)
