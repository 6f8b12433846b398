"""stowlm.Llama: llama-cpp-python's constructor and methods over an LLM. Oracles: llama.cpp's
recorded token ids (../shared/fixtures), an LLM given the same settings directly, numpy norms."""
import json
import warnings

import numpy as np
import pytest

import stowlm
from conftest import FIXTURES, get_model


@pytest.fixture(scope="module")
def llama():
    with stowlm.Llama(str(get_model("smollm2-135m")), n_ctx=1024, n_threads=2, seed=1234, verbose=False) as m:
        yield m


def test_tokens_as_llama_cpp_gives_them(llama):
    recs = [json.loads(line) for line in open(FIXTURES / "smollm2-135m.jsonl")]
    toks = [r for r in recs if r["kind"] == "tok"]
    assert toks
    for r in toks:  # recorded with parse_special=true: llama-cpp-python's special=True
        got = llama.tokenize(r["text"].encode("utf-8"), add_bos=r["add_special"], special=True)
        assert got == r["ids"], r["text"]
        assert llama.detokenize(got, special=True) == r["text"].encode("utf-8")
    ids = llama.tokenize(b"Hello world, again")
    # after the text so far, a piece keeps its leading space
    assert llama.detokenize(ids[1:], prev_tokens=ids[:1]) == b" world, again"
    assert (llama.n_ctx(), llama.n_vocab(), llama.n_embd()) == (1024, 49152, 576)
    assert llama.token_eos() == llama.llm.tokenizer.eos_id and isinstance(llama.token_bos(), int)
    assert llama.metadata["general.architecture"] == "llama"
    assert llama.llm.model.devices[0].threads == 2 and llama.llm.ctx.n_ubatch == 512  # n_threads, n_ubatch taken


def test_calls_give_what_the_llm_gives(llama):
    with stowlm.LLM(str(get_model("smollm2-135m")), n_ctx=1024, progress=False) as llm:
        want = llm.generate("The capital of France is", max_tokens=10, temperature=0).text
        chat = llm.chat([{"role": "user", "content": "Name a color."}], max_tokens=8, temperature=0).text
    out = llama("The capital of France is", max_tokens=10, temperature=0, stop=[], echo=False)
    assert out["choices"][0]["text"] == want and out["object"] == "text_completion"
    c = llama.create_chat_completion(messages=[{"role": "user", "content": "Name a color."}], max_tokens=8,
                                     temperature=0)
    assert c["choices"][0]["message"]["content"] == chat
    llama.reset()
    assert llama("The capital of France is", max_tokens=10, temperature=0)["choices"][0]["text"] == want


def test_a_seed_repeats_a_run_and_each_call_draws_anew():
    path = str(get_model("smollm2-135m"))
    runs = []
    for _ in range(2):
        with stowlm.Llama(path, n_ctx=512, seed=99, verbose=False) as m:
            runs.append([m("Once upon a time", max_tokens=12, temperature=1.0)["choices"][0]["text"]
                         for _ in range(3)])
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1  # not one seed for every call


def test_constructor_arguments_taken_or_refused():
    path = str(get_model("smollm2-135m"))
    # knobs of llama.cpp's speed or residency: taken
    with stowlm.Llama(path, n_ctx=256, use_mlock=True, use_mmap=True, n_batch=128, flash_attn=True, logits_all=True,
                      n_threads_batch=1, type_k=8, type_v=8, verbose=False) as m:
        assert m.llm.ctx.memory_report()[0]["kv"] == stowlm.Model(path).plan(256, kv_type="q8_0")[0]["kv"]
    with stowlm.Llama(path, n_ctx=0, verbose=False) as m:  # 0: the trained context
        assert m.n_ctx() == stowlm.Model(path).n_ctx_train
    for kw, err in ((dict(lora_path="a.bin"), ValueError), (dict(rope_freq_base=5e5), ValueError),
                    (dict(chat_format="llama-2"), ValueError), (dict(type_k=2), ValueError),
                    (dict(frobnicate=1), TypeError), (dict(embedding=True, pooling_type=4), ValueError),
                    (dict(draft_model=object()), ValueError)):
        with pytest.raises(err):
            stowlm.Llama(path, verbose=False, **kw)

    class LlamaPromptLookupDecoding:  # llama-cpp-python's, as its users construct it
        num_pred_tokens = 5
    with stowlm.Llama(path, n_ctx=256, draft_model=LlamaPromptLookupDecoding(), verbose=False) as m:
        assert m.llm.draft_max == 5 and type(m.llm._drafter).__name__ == "NgramDrafter"


def test_gpu_layers_without_a_gpu_run_on_the_cpu_and_say_so():
    found, _ = stowlm._core.cuda.devices()
    if found:
        pytest.skip("a CUDA device is present")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with stowlm.Llama(str(get_model("smollm2-135m")), n_ctx=256, n_gpu_layers=-1, verbose=False) as m:
            assert [d["device"] for d in m.llm.ctx.memory_report()] == ["cpu:0"]
    assert any("n_gpu_layers=-1" in str(x.message) and "runs on the CPU" in str(x.message) for x in w), w


def test_embeddings_as_llama_cpp_python_gives_them():
    path = str(get_model("smollm2-135m"))
    with stowlm.Llama(path, n_ctx=256, embedding=True, pooling_type=1, verbose=False) as m, \
            stowlm.LLM(path, n_ctx=256, embedding=True, pooling="mean", progress=False) as llm:
        raw = np.asarray(m.embed("A sentence to embed."))
        assert abs(np.linalg.norm(raw) - 1) > 1e-3  # llama-cpp-python's embed: not normalized
        np.testing.assert_allclose(raw, llm.embed("A sentence to embed.", normalize=False), rtol=1e-6)
        d = m.create_embedding(["one", "two"])
        assert len(d["data"]) == 2 and d["usage"]["prompt_tokens"] == len(m.tokenize(b"one")) + len(m.tokenize(b"two"))
        assert len(m.embed([7] * 400)) == 576  # cut to the context, as llama-cpp-python's truncate=True
        with pytest.raises(ValueError, match="embedding=True"):
            m("hi", max_tokens=2)
