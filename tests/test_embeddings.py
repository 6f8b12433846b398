"""Embeddings (LLM(embedding=True), stowlm.embedding, `stowlm serve --embeddings`).

Oracles: a float64 pass of the file (tests/float_reference.py: gguf's numpy dequantization, no
stowlm kernel) for the hidden states; the output head dequantized by gguf times those states
against the logits context's own logits; numpy's pooling and norms over the per-token vectors."""
import base64
import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, dequantize, quantize

import stowlm
from conftest import get_model, start_server, stop_server
from float_reference import float_model
from stowlm.embedding import InputTooLong, pooling_of

TEXTS = ["def add(a, b):\n    return a + b", "The quick brown fox jumps over the lazy dog.", "Paris is in France."]


def _cos(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.fixture(scope="module")
def rows_llm():
    """smollm2-135m giving per-token vectors, unnormalized."""
    with stowlm.LLM(str(get_model("smollm2-135m")), embedding=True, pooling="none", n_ctx=512,
                    progress=False) as llm:
        yield llm


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m", "qwen3moe-tiny"])
def test_hidden_states_match_a_float64_pass(name):
    path = get_model(name)
    with stowlm.LLM(str(path), embedding=True, pooling="none", n_ctx=512, progress=False) as llm:
        ids = llm.tokenize(TEXTS[1])
        got = np.asarray(llm.embed(ids, normalize=False))
        n_embd = llm.model.n_embd
    want = float_model(str(path)).hidden(ids, kv_f16=True)
    assert got.shape == want.shape == (len(ids), n_embd)
    # 8-bit activations in every product against float64: 0.993 (gemma3) to 0.9995 a row, and
    # 0.9986 to 0.9999 for their mean
    cos = _cos(got, want)
    assert cos.min() > 0.99 and _cos(got.mean(0), want.mean(0)) > 0.998, cos
    norms = np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert np.all(np.abs(norms - 1) < 0.08), norms


def test_the_hidden_state_is_what_the_head_multiplies():
    path = get_model("smollm2-135m")
    m = stowlm.Model(str(path))
    ids = [1, 504, 3458, 282, 4469, 30, 2]
    hidden = stowlm.Context(m, n_ctx=256, embeddings=True).eval(ids, logits="all")
    logits = stowlm.Context(m, n_ctx=256).eval(ids, logits="all")
    t = {t.name: t for t in GGUFReader(str(path)).tensors}
    head = t.get("output.weight", t["token_embd.weight"])
    assert head.tensor_type == GGMLQuantizationType.Q8_0  # its product quantizes its input to Q8_0 blocks
    w = dequantize(head.data, head.tensor_type).reshape(-1, m.n_embd).astype(np.float64)
    assert hidden.shape == (len(ids), m.n_embd) and logits.shape == (len(ids), m.n_vocab)
    x = dequantize(quantize(hidden, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0).astype(np.float64)
    proj = x @ w.T
    # (a value on a rounding boundary may land one step apart in numpy's quantizer: 4e-4 seen)
    assert _cos(proj, logits).min() > 0.999999 and np.abs(proj - logits).max() < 1e-3 * np.abs(logits).max()
    bare = hidden.astype(np.float64) @ w.T  # what the same check gives the states unquantized
    assert _cos(bare, logits).min() < 0.99999


def test_an_embeddings_context_plans_exactly_and_within_the_logits_context():
    m = stowlm.Model(str(get_model("qwen2.5-coder-0.5b")))
    emb = stowlm.Context(m, n_ctx=512, n_outputs=32, embeddings=True)
    e = emb.memory_report()[0]
    assert e["allocated"] == e["total"] == m.plan(512, n_outputs=32, embeddings=True)[0]["total"]
    del emb
    lg = stowlm.Context(m, n_ctx=512, n_outputs=32)
    l_ = lg.memory_report()[0]
    # the graph is the logits graph less the head: a fit made for generation covers it
    assert e["compute"] <= l_["compute"] and e["weights"] == l_["weights"] and e["kv"] == l_["kv"]
    assert lg.row_width == m.n_vocab and not lg.embeddings


@pytest.mark.parametrize("pooling", ["mean", "last", "cls"])
def test_pooling_reads_the_rows_it_names(rows_llm, pooling):
    with stowlm.LLM(str(get_model("smollm2-135m")), embedding=True, pooling=pooling, n_ctx=512,
                    progress=False) as llm:
        for text in TEXTS:
            rows = np.asarray(rows_llm.embed(text, normalize=False), np.float64)
            want = {"mean": rows.mean(0), "last": rows[-1], "cls": rows[0]}[pooling]
            got = np.asarray(llm.embed(text, normalize=False))
            assert np.allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
            unit = np.asarray(llm.embed(text))
            assert abs(np.linalg.norm(unit) - 1) < 1e-6 and np.allclose(unit, want / np.linalg.norm(want), atol=1e-6)


def test_several_inputs_a_pass_as_one_at_a_time():
    path = str(get_model("smollm2-135m"))
    with stowlm.LLM(path, embedding=True, n_ctx=1024, progress=False) as one, \
            stowlm.LLM(path, embedding=True, n_ctx=1024, n_seq=2, progress=False) as two:
        a, b = np.asarray(one.embed(TEXTS)), np.asarray(two.embed(TEXTS))
        assert a.shape == b.shape == (3, one.model.n_embd)
        assert np.abs(a - b).max() < 1e-4  # other batch sizes may take other kernel classes
        assert _cos(a[0], a[0]) > 0.9999 and _cos(a[0], a[1]) < 0.99
        vec, n = two.embed(TEXTS[0], return_count=True)
        assert n == len(two.tokenize(TEXTS[0])) and np.allclose(vec, a[0], atol=1e-4)
        d = two.create_embedding(TEXTS[:2], model="m")
        assert [x["index"] for x in d["data"]] == [0, 1] and d["model"] == "m" and d["object"] == "list"
        assert d["usage"]["prompt_tokens"] == sum(len(two.tokenize(t)) for t in TEXTS[:2])
        assert np.allclose(d["data"][1]["embedding"], a[1], atol=1e-4)
        raw = base64.b64decode(two.create_embedding(TEXTS[2], encoding_format="base64")["data"][0]["embedding"])
        assert np.allclose(np.frombuffer(raw, "<f4"), a[2], atol=1e-4)


def test_what_an_embeddings_llm_refuses(rows_llm):
    path = str(get_model("smollm2-135m"))
    for call in (lambda: rows_llm.generate("hi"), lambda: rows_llm.logits([1, 2]),
                 lambda: rows_llm.chat([{"role": "user", "content": "hi"}]),
                 lambda: rows_llm.create_completion("hi")):
        with pytest.raises(ValueError, match="embedding=True"):
            call()
    with pytest.raises(ValueError, match="OpenAI's embeddings format"):
        rows_llm.create_embedding("hi")
    with pytest.raises(InputTooLong, match="input\\[1\\] has 600 tokens, more than the 512"):
        rows_llm.embed([[1, 2], [5] * 600])
    assert len(rows_llm.embed([5] * 600, truncate=True)) == 512
    for bad, why in (([], "non-empty"), ([[1], "x", 3.5], "input\\[2\\]"), ([-1, 4], "outside the vocabulary"),
                     ("", "has no tokens"), (7, "non-empty string")):
        with pytest.raises(ValueError, match=why):
            rows_llm.embed(bad)
    with stowlm.LLM(path, n_ctx=256, progress=False) as gen:
        with pytest.raises(ValueError, match="embedding=True"):
            gen.embed("hi")
    with pytest.raises(ValueError, match="pooling must be one of"):
        stowlm.LLM(path, embedding=True, pooling="max", progress=False)
    with pytest.raises(ValueError, match="give embedding=True"):
        stowlm.LLM(path, pooling="mean", progress=False)
    with pytest.raises(ValueError, match="speculative"):
        stowlm.LLM(path, embedding=True, speculative="ngram", progress=False)


def test_the_files_pooling_and_what_cannot_be_computed():
    assert pooling_of({"general.architecture": "qwen2"}) == "mean"
    assert pooling_of({"general.architecture": "qwen3", "qwen3.pooling_type": 3}) == "last"
    assert pooling_of({"general.architecture": "qwen3", "qwen3.pooling_type": 3}, "cls") == "cls"
    with pytest.raises(ValueError, match="f.gguf's qwen3.pooling_type .*'rank'.*classifier head"):
        pooling_of({"general.architecture": "qwen3", "qwen3.pooling_type": 4}, source="f.gguf")
    with pytest.raises(ValueError, match="attention.causal is false"):
        pooling_of({"general.architecture": "bert", "bert.attention.causal": False})


def test_serve_embeddings_with_the_openai_client():
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    path = get_model("smollm2-135m")
    with stowlm.LLM(str(path), embedding=True, n_ctx=1024, n_seq=2, progress=False) as local:
        want = np.asarray(local.embed(TEXTS))
    proc, port = start_server(path, "--embeddings", "--parallel", "2", "-c", "1024")
    try:
        base = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
        r = client.embeddings.create(model="smollm2-135m", input=TEXTS)  # the client asks for base64
        got = np.asarray([d.embedding for d in r.data])
        assert np.abs(got - want).max() < 1e-6 and r.usage.prompt_tokens == sum(len(local.tokenize(t)) for t in TEXTS)
        f = httpx.post(base + "/v1/embeddings", json={"input": local.tokenize(TEXTS[1]), "encoding_format": "float"})
        assert f.status_code == 200 and np.abs(np.asarray(f.json()["data"][0]["embedding"]) - want[1]).max() < 1e-6
        for body, code in (({"input": "x" * 3000}, "context_length_exceeded"), ({"input": "x", "dimensions": 8},
                           "invalid_value"), ({"input": "x", "temperature": 1}, "unsupported_parameter"),
                           ({}, "missing_required_parameter"), ({"input": [[1], {}]}, "invalid_value")):
            e = httpx.post(base + "/v1/embeddings", json=body)
            assert e.status_code == 400 and e.json()["error"]["code"] == code, (body, e.text)
        e = httpx.post(base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert e.status_code == 400 and e.json()["error"]["code"] == "generation_disabled"
        assert "stowlm_embedding_inputs_total 4" in httpx.get(base + "/metrics").text
    finally:
        assert stop_server(proc) == 0
    time.sleep(0.2)
    proc, port = start_server(path, "--parallel", "1", "-c", "512")
    try:
        e = httpx.post(f"http://127.0.0.1:{port}/v1/embeddings", json={"input": "hi"})
        assert e.status_code == 400 and e.json()["error"]["code"] == "embeddings_disabled"
    finally:
        assert stop_server(proc) == 0


def test_cli_embed_prints_each_texts_vector(tmp_path):
    import json
    import subprocess
    import sys

    from conftest import subprocess_env

    path = str(get_model("smollm2-135m"))
    (tmp_path / "t.txt").write_text(TEXTS[0] + "\n\n" + TEXTS[2] + "\n")  # a line each: the code's two lines too
    r = subprocess.run([sys.executable, "-m", "stowlm", "embed", path, "-p", TEXTS[1], "-f", str(tmp_path / "t.txt"),
                        "-q"], capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    got = [json.loads(line) for line in r.stdout.splitlines()]
    with stowlm.LLM(path, embedding=True, progress=False) as llm:
        want = llm.embed([TEXTS[1], *TEXTS[0].splitlines(), TEXTS[2]])
    assert np.abs(np.asarray(got) - np.asarray(want)).max() < 1e-6
    r = subprocess.run([sys.executable, "-m", "stowlm", "embed", path], capture_output=True, text=True,
                       env=subprocess_env(), timeout=300)
    assert r.returncode != 0 and "nothing to embed" in r.stderr
