"""Fit: placements that load with exactly the projected bytes and keep every margin, the
decisions users of llama.cpp tune by hand (context, experts spilled, devices left out), and the
errors for what cannot fit or is malformed."""
import json
import random
import subprocess
import sys

import numpy as np
import pytest

import stowlm
from conftest import DENSE_MODELS, MOE_MODELS, load_fixture, subprocess_env
from stowlm.fit import CTX_STEP, FitError, fit
from stowlm.placement import Placement

MODELS = DENSE_MODELS + MOE_MODELS


def load_and_check(path, placement):
    """Loads the placement; every device allocated exactly its projection and kept its margin."""
    model = stowlm.Model(path, placement=placement)
    ctx = stowlm.Context(model)
    report = {r["device"]: r for r in ctx.memory_report()}
    assert [d.name for d in placement.used_devices] == list(report)
    for d in placement.used_devices:
        r = report[d.name]
        assert r["allocated"] == r["total"] == d.projected["total"], (d.name, r, d.projected)
        assert d.free - r["total"] >= d.margin, (d.name, d.free, r["total"], d.margin)
    assert ctx._c.check_plan() == ""
    return model, ctx


def random_devices(rng):
    """1-8 CPU devices: virtual ones with budgets from 4 MiB to 4 GiB, now and then the host."""
    out, host = [], False
    for i in range(rng.randint(1, 8)):
        threads = rng.choice([1, 2])
        if not host and rng.random() < 0.2:
            out.append(f"cpu:{i}[threads={threads}]")
            host = True
        else:
            out.append(f"cpu:{i}[threads={threads},mem={int(2 ** rng.uniform(22, 32))}]")
    rng.shuffle(out)
    return out


def random_settings(rng, name):
    kw = {}
    if rng.random() < 0.5:
        kw["n_ctx"] = rng.choice([128, 256, 700, 1024, 2048, 4096, 8192])
    else:
        kw["fit_ctx"] = rng.choice([256, 1024, 4096])
        kw["max_ctx"] = rng.choice([2048, 8192, 131072])
    if rng.random() < 0.3:
        kw["n_ubatch"] = rng.choice([16, 64, 256, 512])
    if rng.random() < 0.2:
        kw["kv_type"] = "q8_0"
    if name in MOE_MODELS and rng.random() < 0.2:
        kw["n_cpu_moe"] = rng.randint(0, 3)  # every MoE test model has at least 3 layers
    return kw


def test_random_device_sets_fit_or_refuse(model_path, monkeypatch):
    """500 random heterogeneous device sets x every model, each with random settings: fit either
    refuses with a FitError that names a device (or the host) and what would fit, or its placement
    loads with allocated == projected and the margin held on every device. Every 50th that fits
    also evaluates a prompt, whose logits must equal one device's bit for bit (a layer split and
    overrides only move exact copies). The weights keep the GGUF layout here: repacking them
    (test_repack.py, with its own accounting check) would double this test's time and changes no
    byte that fit counts."""
    monkeypatch.setenv("STOWLM_REPACK", "0")
    rng = random.Random(1234)
    paths = {name: model_path(name) for name in MODELS}
    prompts = {name: next(r for r in load_fixture(name) if r["kind"] == "logits")["ids"] for name in MODELS}
    refs = {}
    counts = {"fit": 0, "refused": 0, "evaluated": 0}
    for case in range(500):
        devices = random_devices(rng)
        for name in MODELS:
            kw = random_settings(rng, name)
            try:
                placement = fit(paths[name], devices, **kw)
            except FitError as e:
                msg = str(e)
                assert "short" in msg or "no device has room" in msg, msg
                assert ("largest context that fits" in msg) == (e.largest_ctx is not None), msg
                assert e.shortfalls and all(v > 0 for v in e.shortfalls.values()), msg
                counts["refused"] += 1
                continue
            for key in ("n_ctx", "n_ubatch", "kv_type"):
                if key in kw:
                    assert getattr(placement, key) == kw[key]
            model, ctx = load_and_check(paths[name], placement)
            counts["fit"] += 1
            if counts["fit"] % 50 == 0:
                ids = prompts[name][: placement.n_ctx]
                key = (name, placement.n_ctx, placement.n_ubatch, placement.kv_type, placement.n_outputs)
                if key not in refs:
                    one = stowlm.Model(paths[name], devices=["cpu:0[threads=2]"])
                    refs[key] = stowlm.Context(one, n_ctx=key[1], n_ubatch=key[2], kv_type=key[3],
                                               n_outputs=key[4]).eval(ids, logits="all")
                np.testing.assert_array_equal(ctx.eval(ids, logits="all"), refs[key],
                                              err_msg=f"{name} on {devices} with {kw}")
                counts["evaluated"] += 1
            del ctx, model
    print(f"\n{counts}")
    assert counts["evaluated"] >= 30 and counts["refused"] >= 50 and counts["fit"] >= 1000, counts


def test_experts_spill_to_the_host_dense_weights_first(model_path):
    """A small and a large accelerator (virtual devices with budgets) plus the host's RAM with a
    mixture-of-experts model: every layer's dense weights and KV on the accelerators, experts of
    the first layers spilled to the host, none more than needed."""
    path = model_path("smollm2-moe")
    devices = ["cpu:1[mem=48MiB]", "cpu:2[mem=96MiB]", "cpu:0"]
    p = fit(path, devices, n_ctx=1024)
    load_and_check(path, p)
    by = {d.name: d for d in p.devices}
    assert not by["cpu:0"].layers, "no whole layer should need the host"
    assert by["cpu:1"].n_layers + by["cpu:2"].n_layers == 30 and by["cpu:2"].holds(29)
    spilled = by["cpu:0"].expert_layers
    assert 0 < len(spilled) < 30 and spilled == list(range(len(spilled))), spilled
    assert any("experts of layers" in d and "cpu:0" in d for d in p.decisions), p.decisions
    # The same spill given as --n-cpu-moe is kept and gives the same placement; one layer's
    # experts fewer and whole layers must move to the host instead.
    same = fit(path, devices, n_ctx=1024, n_cpu_moe=len(spilled))
    assert [d.layers for d in same.devices] == [d.layers for d in p.devices]
    fewer = fit(path, devices, n_ctx=1024, n_cpu_moe=len(spilled) - 1)
    assert {d.name: d for d in fewer.devices}["cpu:0"].layers
    load_and_check(path, fewer)
    # --cpu-moe: every expert on the host.
    every = fit(path, devices, n_ctx=1024, cpu_moe=True)
    assert {d.name: d for d in every.devices}["cpu:0"].expert_layers == list(range(30))
    load_and_check(path, every)


def test_context_is_reduced_only_when_not_set(model_path):
    path = model_path("smollm2-135m")  # trained on 8192
    devices = ["cpu:0[mem=256MiB]"]
    p = fit(path, devices)
    assert 4096 <= p.n_ctx < 8192 and p.n_ctx % CTX_STEP == 0, p.n_ctx
    assert any(d.startswith(f"n_ctx 8192 -> {p.n_ctx}") for d in p.decisions), p.decisions
    load_and_check(path, p)
    # The chosen context is the largest that fits: one step more, set by the user, is refused
    # with the chosen one as the largest that fits.
    with pytest.raises(FitError) as e:
        fit(path, devices, n_ctx=p.n_ctx + CTX_STEP)
    assert e.value.largest_ctx == p.n_ctx and "cpu:0 is short by" in str(e.value)
    assert isinstance(e.value, MemoryError)
    with pytest.raises(FitError) as e:
        fit(path, devices, n_ctx=8192)
    assert e.value.largest_ctx == p.n_ctx and f"n_ctx {p.n_ctx}" in str(e.value) and "set by the user" in str(e.value)
    # A user-set context that fits is kept, even below the floor.
    assert fit(path, devices, n_ctx=1000).n_ctx == 1000
    # Below the floor fit does not go by itself.
    with pytest.raises(FitError) as e:
        fit(path, ["cpu:0[mem=150MiB]"])
    assert "fit_ctx=4096" in str(e.value) and e.value.largest_ctx is not None and e.value.largest_ctx < 4096


def test_a_device_too_small_for_a_layer_is_left_out(model_path):
    path = model_path("smollm2-135m")
    devices = ["cpu:0[mem=2MiB]", "cpu:1[mem=200MiB]", "cpu:2[mem=150MiB]"]
    p = fit(path, devices, n_ctx=2048)
    by = {d.name: d for d in p.devices}
    assert not by["cpu:0"].used and "too small for one layer" in by["cpu:0"].note
    assert [d.name for d in p.used_devices] == ["cpu:1", "cpu:2"]
    assert any("cpu:0 left out" in d for d in p.decisions)
    model, _ = load_and_check(path, p)
    assert [d.name for d in model.devices] == ["cpu:1", "cpu:2"]
    assert "left out" in p.table()


def test_stages_are_balanced_by_threads_and_the_user_split_is_kept(model_path):
    path = model_path("smollm2-135m")
    even = fit(path, ["cpu:0[threads=1,mem=1GiB]", "cpu:1[threads=1,mem=1GiB]"], n_ctx=1024)
    assert [d.n_layers for d in even.devices] == [15, 15]
    uneven = fit(path, ["cpu:0[threads=2,mem=1GiB]", "cpu:1[threads=1,mem=1GiB]"], n_ctx=1024)
    assert [d.n_layers for d in uneven.devices] == [20, 10]
    # a stated speed overrides the thread count: 1.6 : 1 -> 30 * 1.6 / 2.6 = 18.5 layers on cpu:0
    stated = fit(path, ["cpu:0[threads=2,mem=1GiB,speed=1.6]", "cpu:1[threads=1,mem=1GiB]"], n_ctx=1024)
    assert [d.n_layers for d in stated.devices] in ([18, 12], [19, 11])
    assert "speed=1.6" in stated.to_json()
    kept = fit(path, ["cpu:0[mem=1GiB]", "cpu:1[mem=1GiB]"], n_ctx=1024, layer_split=[7, 23])
    # by default each device's layers in two ranges that take turns (7 = 3 + 4, 23 = 11 + 12)
    assert [d.layers for d in kept.devices] == [[(0, 2), (14, 17)], [(3, 13), (18, 29)]]
    assert kept.interleave == 2 and any(x.startswith("interleave 2:") for x in kept.decisions)
    one = fit(path, ["cpu:0[mem=1GiB]", "cpu:1[mem=1GiB]"], n_ctx=1024, layer_split=[7, 23], interleave=1)
    assert [d.layers for d in one.devices] == [[(0, 6)], [(7, 29)]] and one.interleave == 1
    with pytest.raises(FitError):
        fit(path, ["cpu:0[mem=40MiB]", "cpu:1[mem=1GiB]"], n_ctx=1024, layer_split=[29, 1])


def test_interleave_only_where_its_exact_projection_fits(model_path):
    """fit searches contiguous ranges, then takes two ranges per device only if the core's
    projection of that fits too (it crosses devices more often: more copies); else it says why."""
    path = model_path("smollm2-135m")
    kw = dict(n_ctx=1024, layer_split=[15, 15], margin=0)
    one = fit(path, ["cpu:0[mem=1GiB]", "cpu:1[mem=1GiB]"], interleave=1, **kw)
    two = fit(path, ["cpu:0[mem=1GiB]", "cpu:1[mem=1GiB]"], **kw)
    assert two.interleave == 2 and two.devices[0].projected["total"] > one.devices[0].projected["total"]
    tight = one.devices[0].projected["total"]
    p = fit(path, [f"cpu:0[mem={tight}]", "cpu:1[mem=1GiB]"], **kw)
    assert p.interleave == 1 and p.n_copies == 4 and p.devices[0].projected["total"] == tight
    assert any(x.startswith("interleave 1:") and "interleave 2 did not fit (short: cpu:0 by" in x
               for x in p.decisions), p.decisions
    load_and_check(path, p)
    with pytest.raises(ValueError, match="interleave must be a positive integer"):
        fit(path, ["cpu:0", "cpu:1"], interleave=0)


def test_fitting_a_fitted_placement_changes_nothing(model_path, tmp_path):
    path = model_path("qwen3moe-tiny")
    p = fit(path, ["cpu:1[mem=20MiB,threads=1]", "cpu:2[mem=12MiB]", "cpu:0[threads=1]"], n_ctx=2048)
    file = tmp_path / "placement.json"
    p.save(file)
    again = fit(path, placement=file)
    strip = lambda d: {k: v for k, v in d.items() if k not in ("decisions", "host")}  # noqa: E731
    first, second = strip(p.to_dict()), strip(again.to_dict())
    for a, b in zip(first["devices"], second["devices"]):
        if a["name"] == "cpu:0":  # the host's available RAM moves on its own
            a.pop("free"), b.pop("free")
    assert first == second
    assert Placement.from_json(p.to_json()).to_dict() == p.to_dict()
    # A file written before interleaving (one [first, last] per device, no "interleave") still loads.
    old = p.to_dict()
    old.pop("interleave")
    for d in old["devices"]:
        d["layers"] = None
    old["devices"][0]["layers"] = [0, p.model["n_layer"] - 1]
    assert Placement.from_dict(old).devices[0].layers == [(0, p.model["n_layer"] - 1)]
    # The same placement loads through Model, LLM and from the file.
    load_and_check(path, Placement.load(file))
    llm = stowlm.LLM(str(path), placement=str(file), progress=False)
    assert llm.n_ctx == 2048 and [d.name for d in llm.model.devices] == [d.name for d in p.used_devices]
    with pytest.raises(ValueError, match="placement fixes"):
        stowlm.LLM(str(path), placement=str(file), n_ctx=4096, progress=False)


def test_bad_input_is_refused_clearly(model_path, tmp_path):
    path = model_path("qwen3moe-tiny")
    with pytest.raises(ValueError, match="unknown kind"):
        fit(path, ["gpu:0"])
    with pytest.raises(ValueError, match="margin 64.0 MiB for cpu:1 is not smaller than its free memory"):
        fit(path, ["cpu:0", "cpu:1[mem=32MiB]"], margin=[0, 64 << 20])
    with pytest.raises(ValueError, match="2 values for 3 devices"):
        fit(path, ["cpu:0", "cpu:1", "cpu:2"], margin=[1, 2])
    with pytest.raises(ValueError, match=r"override 'nothing_like_this=cpu:1' matches no tensor"):
        fit(path, ["cpu:0", "cpu:1"], tensor_overrides=["nothing_like_this=cpu:1"])
    with pytest.raises(ValueError, match="layer_split"):
        fit(path, ["cpu:0", "cpu:1"], layer_split=[1, 1])
    with pytest.raises(ValueError, match="not a mixture-of-experts"):
        fit(model_path("smollm2-135m"), ["cpu:0"], cpu_moe=True)
    good = fit(path, ["cpu:0", "cpu:1[mem=64MiB]"], n_ctx=512)
    # A placement for another model, whatever loads it.
    other = model_path("smollm2-moe")
    with pytest.raises(ValueError, match="made for another model"):
        fit(other, placement=good)
    with pytest.raises(ValueError, match="made for another model"):
        stowlm.Model(other, placement=good)
    # Corrupted fields are named.
    data = good.to_dict()
    for field, value, needle in [("n_ctx", "4096", "n_ctx must be an integer"),
                                 ("devices", [], "devices is empty"),
                                 ("tensor_overrides", ["x=cuda:9"], "not REGEX=DEVICE"),
                                 ("model", {"arch": "llama"}, "model.fingerprint")]:
        bad = dict(data, **{field: value})
        with pytest.raises(ValueError, match=needle):
            Placement.from_dict(bad, "bad.json")
    bad = json.loads(json.dumps(data))
    bad["devices"][1]["layers"] = [2, "x"]
    with pytest.raises(ValueError, match=r"devices\[1\]\.layers\[1\]"):
        Placement.from_dict(bad, "bad.json")
    bad["devices"][1]["layers"] = [3, 3]
    with pytest.raises(ValueError, match=r"the layer ranges cover 1 layers, model.n_layer is 4"):
        Placement.from_dict(bad, "bad.json")
    (tmp_path / "trunc.json").write_text(good.to_json()[:50])
    with pytest.raises(ValueError, match="trunc.json: not valid JSON"):
        Placement.load(tmp_path / "trunc.json")


def test_fit_error_when_nothing_fits_names_the_output_head(model_path):
    path = model_path("gemma3-270m")  # its tied 262k-row embedding is the output head
    with pytest.raises(FitError) as e:
        fit(path, ["cpu:0[mem=120MiB]", "cpu:1[mem=120MiB]", "cpu:2[mem=120MiB]"], n_ctx=512)
    assert "output head" in str(e.value) and e.value.largest_ctx is None


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "stowlm.cli", *args], capture_output=True, text=True,
                          env=subprocess_env(), timeout=300)


def test_cli_fit_table_json_verify_explain(model_path, tmp_path):
    path = str(model_path("smollm2-moe"))
    devices = "cpu:1[mem=48MiB],cpu:2[mem=96MiB],cpu:0"
    r = run_cli("fit", path, "--devices", devices, "-c", "1024", "--verify", "--explain")
    assert r.returncode == 0, r.stderr
    assert "allocated" in r.stdout and "(= projected)" in r.stdout and "decisions:" in r.stdout
    assert "experts of layers" in r.stdout and r.stdout.count("\n") > 8
    out = tmp_path / "p.json"
    r = run_cli("fit", path, "--devices", devices, "-c", "1024", "--json", "--verify", "-o", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["n_ctx"] == 1024 and data == json.loads(out.read_text())
    for d in data["devices"]:
        assert set(d["projected"]) == {"weights", "kv", "compute", "copies", "total"}
        if d["layers"] is not None or d["expert_layers"]:
            assert d["allocated"] == d["projected"]["total"] and d["free"] - d["allocated"] >= d["margin"]
    r = run_cli("fit", path, "--placement", str(out), "--json")
    assert r.returncode == 0 and [d["layers"] for d in json.loads(r.stdout)["devices"]] == \
        [d["layers"] for d in data["devices"]]
    # Does not fit: exit status 2, the reason on stderr.
    r = run_cli("fit", path, "--devices", "cpu:0[mem=64MiB]", "-c", "8192")
    assert r.returncode == 2 and "cpu:0 is short by" in r.stderr and not r.stdout
    r = run_cli("fit", path, "--devices", "cpu:0", "--fit-margin", "1,2")
    assert r.returncode == 1 and "2 values for 1 devices" in r.stderr
    # stowlm run loads the saved placement and generates.
    r = run_cli("run", path, "--placement", str(out), "-p", "Hello", "-n", "4", "--temp", "0")
    assert r.returncode == 0 and r.stdout.startswith("Hello"), r.stderr


def test_llm_fits_several_devices_by_default(model_path, capsys):
    path = str(model_path("smollm2-135m"))
    llm = stowlm.LLM(path, devices=["cpu:0[mem=96MiB,threads=1]", "cpu:1[mem=160MiB,threads=1]"], n_ctx=1024)
    assert llm.placement is not None and llm.n_ctx == 1024
    assert "fit: n_ctx 1024" in capsys.readouterr().err
    report = llm.ctx.memory_report()
    assert [r["allocated"] for r in report] == [d.projected["total"] for d in llm.placement.used_devices]
    text = llm.generate("The capital of France is", max_tokens=8, temperature=0).text
    one = stowlm.LLM(path, n_ctx=1024, n_threads=2, progress=False)
    assert one.placement is None  # one device it fits: loaded as given
    assert one.generate("The capital of France is", max_tokens=8, temperature=0).text == text
    plain = stowlm.LLM(path, devices=["cpu:0[threads=1]", "cpu:1[threads=1]"], fit=False, progress=False)
    assert plain.placement is None and plain.n_ctx == 4096
    with pytest.raises(FitError):
        stowlm.LLM(path, devices=["cpu:0[mem=64MiB]"], progress=False)


def test_cli_fit_placement_takes_its_own_devices_again(model_path, tmp_path):
    """`stowlm fit --devices LIST --placement FILE`: LIST may be the placement's own devices (in
    any order); other devices are refused, naming what differs."""
    path = str(model_path("smollm2-moe"))
    devices = "cpu:1[mem=48MiB],cpu:2[mem=96MiB],cpu:0"
    out = tmp_path / "p.json"
    r = run_cli("fit", path, "--devices", devices, "-c", "1024", "--json", "-o", str(out))
    assert r.returncode == 0, r.stderr
    layers = [d["layers"] for d in json.loads(out.read_text())["devices"]]
    for same in (devices, "cpu:0,cpu:2[mem=96MiB],cpu:1[mem=48MiB]"):
        r = run_cli("fit", path, "--devices", same, "--placement", str(out), "--json")
        assert r.returncode == 0, r.stderr
        assert [d["layers"] for d in json.loads(r.stdout)["devices"]] == layers
    r = run_cli("fit", path, "--devices", "cpu:1[mem=64MiB],cpu:2[mem=96MiB],cpu:3", "--placement", str(out))
    assert r.returncode == 1 and not r.stdout
    assert "its cpu:1 is cpu:1[mem=48MiB], not cpu:1[mem=64MiB]" in r.stderr, r.stderr
    assert "cpu:3 is not one of its devices" in r.stderr and "its cpu:0 is not in the list" in r.stderr, r.stderr
    # what fit decides is still refused next to a placement
    r = run_cli("fit", path, "--devices", devices, "--placement", str(out), "-c", "512")
    assert r.returncode == 1 and "drop n_ctx" in r.stderr, r.stderr


def test_cli_run_placement_takes_its_own_devices_again(model_path, tmp_path):
    """`stowlm run --devices LIST --placement FILE`, as fit does: LIST may be the placement's own
    devices (in any order), and the same text comes out; other devices are refused, naming what
    differs, before anything is loaded."""
    path = str(model_path("smollm2-moe"))
    devices = "cpu:1[mem=48MiB],cpu:2[mem=96MiB],cpu:0"
    out = tmp_path / "p.json"
    r = run_cli("fit", path, "--devices", devices, "-c", "1024", "--json", "-o", str(out))
    assert r.returncode == 0, r.stderr
    prompt = ("-p", "Hello", "-n", "4", "--temp", "0", "-q")
    alone = run_cli("run", path, "--placement", str(out), *prompt)
    assert alone.returncode == 0 and alone.stdout.startswith("Hello"), alone.stderr
    for same in (devices, "cpu:0,cpu:2[mem=96MiB],cpu:1[mem=48MiB]"):
        r = run_cli("run", path, "--devices", same, "--placement", str(out), *prompt)
        assert r.returncode == 0, r.stderr
        assert r.stdout == alone.stdout
    r = run_cli("run", path, "--devices", "cpu:1[mem=64MiB],cpu:2[mem=96MiB],cpu:3", "--placement", str(out), *prompt)
    assert r.returncode == 1 and not r.stdout
    assert "its cpu:1 is cpu:1[mem=48MiB], not cpu:1[mem=64MiB]" in r.stderr, r.stderr
    assert "cpu:3 is not one of its devices" in r.stderr and "its cpu:0 is not in the list" in r.stderr, r.stderr
    # what fit decides is still refused next to a placement
    r = run_cli("run", path, "--devices", devices, "--placement", str(out), "-c", "512", *prompt)
    assert r.returncode == 1 and "drop n_ctx" in r.stderr, r.stderr


def test_the_fitters_shared_foundation():
    """The searches and budgets the layer, tensor and rank fitters share."""
    from stowlm.devices import DeviceSpec
    from stowlm.placement.budgets import Dev, over, shares_of
    from stowlm.placement.search import context_range, largest, largest_context, largest_fitting, smallest

    assert largest(1, 10, lambda x: x <= 7) == 7 and largest(3, 3, lambda x: False) == 3
    assert smallest(0, 10, lambda x: x >= 4) == 4 and smallest(0, 0, lambda x: True) == 0
    assert largest_fitting([256, 512, 768, 1024], lambda c: c if c <= 700 else None) == (512, 512)
    assert largest_fitting([256, 512], lambda c: None) is None
    assert largest_context(256, 2048, 256, lambda c: c if c <= 1000 else None) == (768, 768)
    assert largest_context(256, 2048, 256, lambda c: c) == (2048, 2048)
    assert context_range(32768, 131072, 4096, 1) == (4096, 32768)
    assert context_range(2048, 131072, 4096, 1) == (2048, 2048)
    assert context_range(32768, 8192, 4096, 3) == (3 * 1280, 3 * 2560)  # whole slots of 256 cells
    assert shares_of([100, 300, -5]) == [0.25, 0.75, 0.0] and shares_of([1, 3], 8) == [2.0, 6.0]
    cpu = lambda i, mem: Dev(i, DeviceSpec("cpu", i, mem_bytes=mem), mem, mem, 10, 1.0, 1, "its budget")  # noqa: E731
    devs = [cpu(0, 100), cpu(1, 100)]
    assert over(devs, [95, 80], 1000, 0) == {"cpu:0": 5}
    assert over(devs, [90, 80], 160, 0) == {"host RAM": 10} and over(devs, [90, 80], 170, 0) == {}
