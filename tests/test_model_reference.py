"""The engine's graphs against the independent float64 numpy forward pass of
tests/float_reference.py, on tiny synthetic GGUF models with F32 weights (no weight or activation
quantization, so agreement is tight).

Covers each architecture's wiring (biases, q/k norms, pre/post norms, GELU vs SiLU, NeoX vs
adjacent-pair RoPE, tied vs separate output, gemma3's embedding scale, sliding-window layers
with their own RoPE base and a window small enough to matter), several devices, micro-batches,
custom positions and the Q8_0 KV cache."""
import numpy as np
import pytest

import stowlm
from float_reference import FloatModel

gguf = pytest.importorskip("gguf")

N_EMBD, N_HEAD, N_HEAD_KV, N_FF, N_VOCAB, N_LAYER = 64, 4, 2, 96, 256, 6
EPS, BASE = 1e-6, 10000.0
GEMMA_HEAD_DIM, GEMMA_WINDOW, GEMMA_BASE = 32, 4, 1e6


def head_dim(arch):
    return GEMMA_HEAD_DIM if arch == "gemma3" else N_EMBD // N_HEAD


def make_model(path, arch, tied, seed=0):
    rng = np.random.default_rng(seed)
    hd = head_dim(arch)

    def rnd(*shape, s=0.2):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    def norm_w(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.embedding_length", N_EMBD)
    w.add_uint32(f"{arch}.block_count", N_LAYER)
    w.add_uint32(f"{arch}.attention.head_count", N_HEAD)
    w.add_uint32(f"{arch}.attention.head_count_kv", N_HEAD_KV)
    w.add_uint32(f"{arch}.feed_forward_length", N_FF)
    w.add_uint32(f"{arch}.context_length", 512)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", EPS)
    w.add_float32(f"{arch}.rope.freq_base", GEMMA_BASE if arch == "gemma3" else BASE)
    if arch == "gemma3":
        w.add_uint32(f"{arch}.attention.key_length", hd)
        w.add_uint32(f"{arch}.attention.value_length", hd)
        w.add_uint32(f"{arch}.attention.sliding_window", GEMMA_WINDOW)
    T = {"token_embd.weight": rnd(N_VOCAB, N_EMBD, s=1.0), "output_norm.weight": norm_w(N_EMBD)}
    if not tied:
        T["output.weight"] = rnd(N_VOCAB, N_EMBD)
    for il in range(N_LAYER):
        p = f"blk.{il}."
        T[p + "attn_norm.weight"] = norm_w(N_EMBD)
        T[p + "attn_q.weight"] = rnd(N_HEAD * hd, N_EMBD)
        T[p + "attn_k.weight"] = rnd(N_HEAD_KV * hd, N_EMBD)
        T[p + "attn_v.weight"] = rnd(N_HEAD_KV * hd, N_EMBD)
        T[p + "attn_output.weight"] = rnd(N_EMBD, N_HEAD * hd)
        T[p + "ffn_norm.weight"] = norm_w(N_EMBD)
        T[p + "ffn_gate.weight"] = rnd(N_FF, N_EMBD)
        T[p + "ffn_up.weight"] = rnd(N_FF, N_EMBD)
        T[p + "ffn_down.weight"] = rnd(N_EMBD, N_FF)
        if arch == "qwen2":
            T[p + "attn_q.bias"] = rnd(N_HEAD * hd)
            T[p + "attn_k.bias"] = rnd(N_HEAD_KV * hd)
            T[p + "attn_v.bias"] = rnd(N_HEAD_KV * hd)
        if arch in ("qwen3", "gemma3"):
            T[p + "attn_q_norm.weight"] = norm_w(hd)
            T[p + "attn_k_norm.weight"] = norm_w(hd)
        if arch == "gemma3":
            T[p + "post_attention_norm.weight"] = norm_w(N_EMBD)
            T[p + "post_ffw_norm.weight"] = norm_w(N_EMBD)
    for name, arr in T.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return T


def reference(path, ids, pos=None, **overrides):
    """tests/float_reference.py on the written file, keys and values rounded to F16 as the cache holds them."""
    return FloatModel(path, **overrides).logits(ids, positions=pos, kv_f16=True)


def assert_close(got, want, what):
    err = np.abs(got - want).max() / np.abs(want).max()
    print(f"{what}: max error {err:.1e}")
    assert err < 2e-3, f"{what}: max error {err:.2e} relative to the largest logit"


CASES = [("llama", True), ("llama", False), ("qwen2", False), ("qwen3", True), ("gemma3", True)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    made = {}

    def get(arch, tied):
        if (arch, tied) not in made:
            path = tmp_path_factory.mktemp("tiny") / f"{arch}-{'tied' if tied else 'untied'}.gguf"
            made[arch, tied] = (path, make_model(path, arch, tied))
        return made[arch, tied]

    return get


@pytest.mark.parametrize("arch,tied", CASES)
def test_architecture_matches_numpy(tiny, arch, tied):
    path, T = tiny(arch, tied)
    ids = [(7 * i + 3) % N_VOCAB for i in range(13)]
    want = reference(path, ids)
    model = stowlm.Model(path, devices=["cpu:0[threads=1]"])
    assert model.arch == arch and model.n_vocab == N_VOCAB
    ctx = stowlm.Context(model, n_ctx=32, n_ubatch=16)
    assert_close(ctx.eval(ids, logits="all"), want, f"{arch} one batch")
    # micro-batches of 4, then token-by-token decoding of the last three
    ctx = stowlm.Context(model, n_ctx=32, n_ubatch=4)
    got = ctx.eval(ids[:10], logits="all")
    rows = [ctx.eval([t]) for t in ids[10:]]
    assert_close(np.vstack([got] + rows), want, f"{arch} micro-batches + decode")


def test_sliding_window_and_positions(tiny):
    """gemma3 with a window of 4 over 13 tokens, fed with gaps in the positions: local layers
    see only keys within the window by position, global layers see everything."""
    path, T = tiny("gemma3", True)
    ids = [(5 * i + 1) % N_VOCAB for i in range(13)]
    pos = [0, 1, 2, 3, 10, 11, 12, 13, 14, 15, 20, 21, 22]
    want = reference(path, ids, pos)
    ctx = stowlm.Context(stowlm.Model(path, devices=["cpu:0[threads=1]"]), n_ctx=32, n_ubatch=8)
    assert_close(ctx.eval(ids, positions=pos, logits="all"), want, "gemma3 window + positions")
    # The window does matter here: without it the reference differs.
    unwindowed = reference(path, ids, pos, window=1000)
    assert np.abs(unwindowed - want).max() > 1e-2


@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False)])
def test_layer_splits_and_q8_kv(tiny, arch, tied):
    path, T = tiny(arch, tied)
    ids = [(11 * i + 5) % N_VOCAB for i in range(9)]
    want = reference(path, ids)
    for split in ([3, 3], [1, 2, 3], [0, 6, 0]):
        devices = [f"cpu:{i}[threads=1,mem=64MiB]" for i in range(len(split))]
        model = stowlm.Model(path, devices=devices, layer_split=split)
        ctx = stowlm.Context(model, n_ctx=16, n_ubatch=4)
        assert_close(ctx.eval(ids, logits="all"), want, f"{arch} split {split}")
    # head_dim 16: Q8_0 blocks of 32 cannot hold a head
    with pytest.raises(ValueError, match="head_dim is 16"):
        stowlm.Context(stowlm.Model(path, devices=["cpu:0[threads=1]"]), n_ctx=16, kv_type="q8_0")


def test_q8_0_kv_cache(tiny):
    path, T = tiny("gemma3", True)  # head_dim 32
    ids = [(11 * i + 5) % N_VOCAB for i in range(9)]
    want = reference(path, ids)
    model = stowlm.Model(path, devices=["cpu:0[threads=1]"])
    f16_kv = stowlm.Context(model, n_ctx=16, kv_type="f16")
    q8_kv = stowlm.Context(model, n_ctx=16, kv_type="q8_0")
    assert q8_kv.memory_report()[0]["kv"] < f16_kv.memory_report()[0]["kv"]
    got = q8_kv.eval(ids, logits="all")
    err = np.abs(got - want).max() / np.abs(want).max()
    assert 1e-5 < err < 3e-2, f"Q8_0 KV: max error {err:.2e}"  # close, but not the F16 numbers


def test_tensor_overrides(tiny):
    """FFN weights of every layer on a second device while attention stays on the first: the
    scheduler runs the FFN matmuls there and copies activations both ways; same logits."""
    path, T = tiny("qwen3", True)
    ids = [(3 * i + 2) % N_VOCAB for i in range(9)]
    want = reference(path, ids)
    devices = ["cpu:0[threads=1,mem=64MiB]", "cpu:1[threads=1,mem=64MiB]"]
    model = stowlm.Model(path, devices=devices, layer_split=[6, 0],
                         overrides={r"blk\.\d+\.ffn_(gate|up|down)\.weight": "cpu:1"})
    assert model.tensor_device("blk.2.ffn_up.weight") == 1
    assert model.tensor_device("blk.2.ffn_norm.weight") == 0
    assert model.tensor_device("blk.2.attn_q.weight") == 0
    ffn_bytes = sum(T[f"blk.{il}.ffn_{t}.weight"].nbytes for il in range(N_LAYER) for t in ("gate", "up", "down"))
    ctx = stowlm.Context(model, n_ctx=16, n_ubatch=4)
    report = ctx.memory_report()
    assert report[1]["weights"] == ffn_bytes
    assert report[0]["copies"] > 0 and report[1]["copies"] > 0
    assert all(r["allocated"] == r["total"] for r in report)
    assert_close(ctx.eval(ids, logits="all"), want, "qwen3 with FFN weights on cpu:1")
    with pytest.raises(ValueError, match="cpu:7"):
        stowlm.Model(path, devices=devices, overrides={"ffn": "cpu:7"})
    with pytest.raises(ValueError, match="regular expression"):
        stowlm.Model(path, devices=devices, overrides={"ffn[": 1})
