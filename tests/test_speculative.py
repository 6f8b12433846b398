"""Speculative decoding: a pass over several tokens gives each the logits of a one-token step (the
ground speculation stands on), greedy text with drafts equal to the text without, and sampled text
with the target's distribution."""
import functools
import subprocess
import sys

import numpy as np
import pytest

import stowlm
from stowlm.engine import Context
from stowlm.speculative import ModelDrafter, NgramDrafter

from conftest import REPO, get_model, subprocess_env


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen3moe-tiny", "gemma3-270m"])
def test_a_pass_of_several_tokens_gives_each_the_logits_of_one_token_steps(name):
    """Contexts of one sequence cut a query's cells at fixed boundaries sized by the cache, so the
    split no longer follows the call's size (before, prompts past 768 cells differed)."""
    model = stowlm.Model(str(get_model(name)))
    toks = np.random.default_rng(0).integers(100, 1000, size=1200).tolist()
    for n_prompt, k in [(10, 5), (255, 9), (760, 16), (1020, 10)]:
        steps = Context(model, n_ctx=2048, n_ubatch=512, n_outputs=32)
        steps.eval(toks[:n_prompt], logits="last")
        one = np.stack([steps.eval([t], logits="last").reshape(-1) for t in toks[n_prompt:n_prompt + k]])
        pass_ = Context(model, n_ctx=2048, n_ubatch=512, n_outputs=32)
        pass_.eval(toks[:n_prompt], logits="last")
        many = pass_.eval(toks[n_prompt:n_prompt + k], logits="all")
        assert np.array_equal(one, many), (name, n_prompt, k, float(np.abs(one - many).max()))


CODE = '''def compute_total(items, tax_rate):
    total = 0
    for item in items:
        price = item["price"] * item["quantity"]
        total = total + price
    return round(total + total * tax_rate, 2)


def format_receipt(items, tax_rate):
    lines = [f"{item['name']}: {item['price']}" for item in items]
    lines.append(f"Total: {compute_total(items, tax_rate)}")
    return "\\n".join(lines)
'''
EDIT = [{"role": "user", "content": "Rename compute_total to calculate_total in this code and show all of it:\n\n" + CODE}]


class _Oracle:
    """Drafts the text a plain run wrote, every third draft spoiled: both the kept and the rejected
    paths run on any model, noise models included (whose text no n-gram ever predicts)."""

    cheap = True

    def __init__(self, text_tokens, prompt_len):
        self.want, self.n, self.calls = text_tokens, prompt_len, 0

    def draft(self, history, k):
        self.calls += 1
        out = list(self.want[len(history) - self.n:len(history) - self.n + min(k, 3)])
        if self.calls % 3 == 0 and out:
            out[-1] = (out[-1] + 1) % 1000
        return out, "oracle"


@pytest.mark.parametrize("name", ["qwen3moe-tiny", "smollm2-moe", "gptoss-tiny"])
def test_drafts_on_mixture_of_experts_models_keep_the_greedy_text(name):
    """Routed experts: a pass's tokens pick experts each, every expert's product stays on the row
    kernels (fewer tokens than the batch bound), so a drafted pass changes nothing."""
    path = str(get_model(name))
    with stowlm.LLM(path, n_ctx=1024, progress=False) as plain:
        prompt = plain.tokenize("The quick brown fox jumps over the lazy dog. " * 3)
        want = plain.generate(prompt, max_tokens=60, temperature=0)
    oracle = _Oracle(want.tokens, len(prompt))
    with stowlm.LLM(path, n_ctx=1024, progress=False, speculative=oracle, draft_max=4) as spec:
        got = spec.generate(prompt, max_tokens=60, temperature=0)
    assert got.tokens == want.tokens
    assert got.accepted > 10 and got.drafted > got.accepted


@pytest.mark.parametrize("name,draft_max", [("smollm2-135m", 3), ("smollm2-135m", 8), ("gemma3-270m", 5)])
def test_greedy_text_with_drafts_is_the_text_without(name, draft_max):
    path = str(get_model(name))
    kw = dict(max_tokens=160, temperature=0, repeat_penalty=1.0)
    with stowlm.LLM(path, n_ctx=2048, progress=False) as plain, \
            stowlm.LLM(path, n_ctx=2048, progress=False, speculative="ngram", draft_max=draft_max) as spec:
        prompts = [CODE + "\n\n" + CODE[:200], "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7,"]
        for prompt in prompts:
            want = plain.generate(prompt, **kw)
            got = spec.generate(prompt, **kw)
            assert got.tokens == want.tokens and got.text == want.text and got.finish_reason == want.finish_reason
            assert got.drafted > 0
        if name != "gemma3-270m":  # gemma3-270m is a base model without a chat template
            want, got = plain.chat(EDIT, **kw), spec.chat(EDIT, **kw)
            assert got.tokens == want.tokens and got.accepted > 0
        # the ends: a stop string, max_tokens, streamed pieces
        for extra in ({"stop": ["total"]}, {"max_tokens": 7}, {"stop": ["\n\n"], "max_tokens": 50}):
            k = dict(kw, **extra)
            want = plain.generate(prompts[0], **k)
            got = spec.generate(prompts[0], **k)
            assert (got.text, got.finish_reason, got.completion_tokens) == \
                (want.text, want.finish_reason, want.completion_tokens), extra
        s = spec.generate(prompts[1], stream=True, **kw)
        assert "".join(s) == plain.generate(prompts[1], **kw).text
        # the cache kept what the text kept: a follow-up that extends the text reuses it exactly
        follow = prompts[1] + got.text + " and"
        assert spec.generate(follow, **kw).tokens == plain.generate(follow, **kw).tokens


def test_a_drafted_token_is_kept_with_the_samplers_probability():
    """sample_draft's output follows candidates()' distribution whatever the draft (the oracle: the
    sampler's own filtered distribution, itself checked against llama.cpp's chain)."""
    from stowlm.text.sampling import Sampler, SamplingParams

    rng = np.random.default_rng(3)
    logits = (rng.normal(size=50) * 1.5).astype(np.float32)
    for params in (SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=1),
                   SamplingParams(temperature=0.7, top_k=10, top_p=0.9, min_p=0.02, seed=2)):
        s = Sampler(params)
        ids, probs = s.candidates(logits)
        want = dict(zip(ids.tolist(), probs.tolist()))
        for draft in (int(ids[0]), int(ids[len(ids) // 2]), int(np.argmin(logits))):
            n = 40000
            counts = {}
            for _ in range(n):
                t, kept = s.sample_draft(logits, [], draft)
                assert kept == (t == draft)
                counts[t] = counts.get(t, 0) + 1
            assert set(counts) <= set(want)
            for t, q in want.items():  # within 5 standard deviations of a binomial count
                assert abs(counts.get(t, 0) / n - q) <= 5 * np.sqrt(q * (1 - q) / n) + 1e-4, (draft, t)


def test_sampled_text_with_drafts_has_the_distribution_without():
    """End to end: the first tokens of many seeded samples, with and without drafts, compared by a
    two-sample chi-square test (a fixed set of seeds: the outcome is deterministic)."""
    path = str(get_model("smollm2-135m"))
    prompt = "1 2 3 4 5 1 2 3 4 5 1 2 3 4 5 1 2 3"
    with stowlm.LLM(path, n_ctx=512, progress=False) as plain, \
            stowlm.LLM(path, n_ctx=512, progress=False, speculative="ngram", draft_max=3) as spec:
        for temperature in (1.0, 1.3):
            kw = dict(max_tokens=4, temperature=temperature, top_k=0, top_p=1.0, min_p=0.0)
            a = [tuple(plain.generate(prompt, seed=s, **kw).tokens[:3]) for s in range(300)]
            runs = [spec.generate(prompt, seed=10_000 + s, **kw) for s in range(300)]
            b = [tuple(r.tokens[:3]) for r in runs]
            drafted, accepted = sum(r.drafted for r in runs), sum(r.accepted for r in runs)
            assert accepted > 100 and drafted > accepted, (drafted, accepted)
            keys = sorted(set(a) | set(b))
            ca = np.array([a.count(k) for k in keys], dtype=np.float64)
            cb = np.array([b.count(k) for k in keys], dtype=np.float64)
            keep = (ca + cb) >= 10  # pool the rare outcomes
            ca = np.append(ca[keep], ca[~keep].sum())
            cb = np.append(cb[keep], cb[~keep].sum())
            nz = (ca + cb) > 0
            chi2 = float((((ca - cb) ** 2) / (ca + cb))[nz].sum())
            dof = int(nz.sum()) - 1
            assert dof >= 2 and chi2 < dof + 4 * np.sqrt(2 * dof) + 6, (temperature, chi2, dof)


def test_the_batch_engine_drafts_per_slot_and_keeps_every_requests_text():
    """Continuous batching with drafts: each slot drafts for itself, passes carry several slots'
    pending tokens and drafts, and every request's greedy text (and logprobs) is the one it gets
    without drafts, alone or among others."""
    path = str(get_model("smollm2-135m"))
    prompts = [CODE + "\n\n" + CODE[:150], "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4,", "Once upon a time",
               "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\ndef fib("]
    kw = dict(max_tokens=80, temperature=0)
    with stowlm.LLM(path, n_ctx=4 * 1024, n_seq=4, progress=False) as plain:
        want = [plain.generate(p, **kw) for p in prompts]
    with stowlm.LLM(path, n_ctx=4 * 1024, n_seq=4, progress=False, speculative="ngram") as spec:
        alone = [spec.generate(p, **kw) for p in prompts]
        runs = [spec.generate(p, stream=True, **kw) for p in prompts]
        for r in runs:
            for _ in r:
                pass
        together = [r.completion for r in runs]
        eng = spec.engine()
        st = eng.stats()
        off = spec.generate(prompts[0], speculative=False, **kw)
    for w, a, t in zip(want, alone, together):
        assert a.tokens == w.tokens and t.tokens == w.tokens and t.text == w.text
    assert sum(a.accepted for a in alone) > 20 and sum(t.drafted for t in together) > 0
    assert st["drafted_total"] >= sum(a.drafted for a in alone) + sum(t.drafted for t in together)
    assert off.tokens == want[0].tokens and off.drafted == 0


def test_the_server_drafts_and_reports_it():
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    from conftest import start_server, stop_server

    path = get_model("smollm2-135m")
    prompt = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2,"
    with stowlm.LLM(str(path), n_ctx=2 * 1024, n_seq=2, progress=False) as plain:
        want = plain.generate(prompt, max_tokens=40, temperature=0).text
    proc, port = start_server(path, "--parallel", "2", "-c", "2048", "--spec", "ngram", "--draft-max", "5")
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        r = c.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=40, temperature=0)
        assert r.choices[0].text == want
        d = r.usage.completion_tokens_details
        assert d.accepted_prediction_tokens > 10 and d.rejected_prediction_tokens >= 0
        extra = r.usage.model_extra
        assert extra["drafted_tokens"] == d.accepted_prediction_tokens + d.rejected_prediction_tokens
        s = c.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=40, temperature=0, stream=True)
        assert "".join(ch.choices[0].text for ch in s) == want
        m = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        kept = float(next(line.split()[1] for line in m.splitlines() if line.startswith("stowlm_draft_tokens_accepted_total")))
        assert kept >= 2 * d.accepted_prediction_tokens
    finally:
        assert stop_server(proc) == 0


def test_make_draft_writes_the_models_own_layers(tmp_path):
    """The tool's draft with every layer and the output as it was is the model itself (same
    logits); with fewer layers it has them (and loads); with a Q4_0 output its logits stay close."""
    from stowlm.draftmodel import make_draft, pick_layers

    src = get_model("smollm2-135m")
    assert pick_layers(30, 10) == [0, 1, 2, 7, 12, 17, 22, 27, 28, 29]
    same = make_draft(src, tmp_path / "same.gguf", layers=range(30), output_type="same")
    toks = list(range(200, 260))
    a = Context(stowlm.Model(str(src)), n_ctx=128).eval(toks, logits="all")
    b = Context(stowlm.Model(str(same)), n_ctx=128).eval(toks, logits="all")
    assert np.array_equal(a, b)
    small = stowlm.Model(str(make_draft(src, tmp_path / "small.gguf", keep=12)))
    assert small.n_layer == 12 and small.n_vocab == 49152
    q4 = Context(stowlm.Model(str(make_draft(src, tmp_path / "q4.gguf", keep=30))), n_ctx=128).eval(toks, logits="all")
    assert (q4.argmax(-1) == a.argmax(-1)).mean() > 0.8
    with pytest.raises(ValueError, match="keep"):
        make_draft(src, tmp_path / "bad.gguf", keep=31)


def test_make_draft_takes_the_first_weight_type_that_fits_each_matrix(tmp_path):
    """--weight-type Q3_K,Q4_0: smollm2's ffn_down rows (1536) are whole 256-blocks and take Q3_K,
    its other matrices (rows of 576) Q4_0; a type the package does not know fails before writing."""
    import gguf

    from stowlm.draftmodel import make_draft

    src = get_model("smollm2-135m")
    out = make_draft(src, tmp_path / "mixed.gguf", keep=4, weight_type="Q3_K,Q4_0")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert {types[f"blk.{i}.ffn_down.weight"] for i in range(4)} == {"Q3_K"}
    assert {types[f"blk.{i}.{m}.weight"] for i in range(4) for m in ("attn_q", "attn_output", "ffn_up")} == {"Q4_0"}
    assert stowlm.Model(str(out)).n_layer == 4
    for bad in ("Q9_Z", "Q4_0,IQ2_XXS"):  # unknown; known but not written by stowlm
        with pytest.raises(ValueError, match=bad.split(",")[-1]):
            make_draft(src, tmp_path / "bad.gguf", keep=4, weight_type=bad)
        assert not (tmp_path / "bad.gguf").exists()


class Free(ModelDrafter):
    """A draft model whose steps count as free, so that it always drafts (its own drafts alone,
    unless lookup=True)."""

    def __init__(self, llm, lookup=False):
        super().__init__(llm, lookup=lookup)

    def draft(self, history, k):
        out = super().draft(history, k)
        self.seconds = 1e-9
        return out


def test_a_draft_model_keeps_the_greedy_text(tmp_path):
    from stowlm.draftmodel import make_draft

    src = str(get_model("smollm2-135m"))
    draft = make_draft(src, tmp_path / "draft.gguf", keep=30)

    prompt = "The history of the Roman Empire began"
    with stowlm.LLM(src, n_ctx=1024, progress=False) as plain:
        want = plain.generate(prompt, max_tokens=60, temperature=0)
    drafter = Free(stowlm.LLM(str(draft), n_ctx=1024, progress=False))
    with stowlm.LLM(src, n_ctx=1024, progress=False, speculative=drafter, draft_max=4) as spec:
        got = spec.generate(prompt, max_tokens=60, temperature=0)
        by_path = stowlm.LLM(src, n_ctx=1024, progress=False, speculative=str(draft))
        assert by_path.generate(prompt, max_tokens=60, temperature=0).tokens == want.tokens
        by_path.close()
    assert got.tokens == want.tokens and got.drafted > 20 and got.accepted > 10
    with pytest.raises(ValueError, match="vocabulary"):
        stowlm.LLM(src, n_ctx=256, progress=False, speculative=str(get_model("qwen2.5-coder-0.5b")))


def test_fit_counts_the_draft_model(tmp_path):
    """A draft model loads first, on the target's first device, and fit counts what it holds
    there: a budget that holds the target alone is short with the draft (FitError saying so),
    and one with room for both loads them within it."""
    from stowlm.draftmodel import make_draft

    src = str(get_model("smollm2-135m"))
    draft = str(make_draft(src, tmp_path / "draft.gguf", keep=6))

    def total(path):  # what a model takes on a roomy budgeted device at n_ctx 2048
        with stowlm.LLM(path, devices="cpu:1[threads=1,mem=1GiB]", n_ctx=2048, progress=False) as m:
            return m.ctx.memory_report()[0]["total"]

    def budget_for(n):  # MiB whose default margin (1/16) leaves n + 8 MiB
        return -(-(n + (8 << 20)) * 16 // 15 // (1 << 20))

    need, held = total(src), total(draft)
    alone = f"cpu:1[threads=1,mem={budget_for(need)}MiB]"
    with stowlm.LLM(src, devices=alone, n_ctx=2048, progress=False) as llm:
        assert llm.ctx.memory_report()[0]["total"] == need
    with pytest.raises(MemoryError, match="held by the draft model"):
        stowlm.LLM(src, devices=alone, n_ctx=2048, progress=False, speculative=draft)
    both = budget_for(need + held) << 20
    with stowlm.LLM(src, devices=f"cpu:1[threads=1,mem={both >> 20}MiB]", n_ctx=2048, progress=False,
                    speculative=draft) as llm:
        d = llm._drafter.llm.ctx.memory_report()[0]
        assert d["device"] == "cpu:1" and d["total"] == held
        assert d["total"] + llm.ctx.memory_report()[0]["total"] <= both
        assert llm.generate("The capital of France is", max_tokens=8, temperature=0).text


def test_make_draft_keeps_the_first_tokens_and_the_special_ones(tmp_path):
    """--vocab N: the draft's vocabulary is the target's first N tokens and its special ones (at
    the end of qwen2.5's, renumbered after them), its embedding and output rows those tokens' rows
    (the embedding's bytes as they were; the output requantized from the gguf package's
    dequantization), its special ids following their tokens, and the ids it was cut from stored."""
    import gguf
    from gguf.quants import dequantize, quantize

    from stowlm.draftmodel import TOKEN_IDS_KEY, keep_tokens, make_draft

    src = get_model("qwen2.5-coder-0.5b")
    draft = make_draft(src, tmp_path / "draft.gguf", keep=2, vocab=4096, weight_type="Q4_0")
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(draft)

    def field(r, key):
        f = r.fields[key]
        return [bytes(f.parts[i]) if f.types[-1] == gguf.GGUFValueType.STRING else f.parts[i].tolist()[0]
                for i in f.data]

    types = np.array(field(a, "tokenizer.ggml.token_type"))
    rows = keep_tokens(types, 4096)
    special = np.flatnonzero(np.isin(types, (3, 4)))
    assert rows[:4096].tolist() == list(range(4096)) and rows[4096:].tolist() == special.tolist()
    assert field(b, TOKEN_IDS_KEY) == rows.tolist()
    src_tokens, tokens = field(a, "tokenizer.ggml.tokens"), field(b, "tokenizer.ggml.tokens")
    assert tokens == [src_tokens[i] for i in rows]
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id"):
        assert tokens[field(b, key)[0]] == src_tokens[field(a, key)[0]]
    ta, tb = ({t.name: t for t in r.tensors} for r in (a, b))
    assert np.array_equal(np.asarray(tb["token_embd.weight"].data), np.asarray(ta["token_embd.weight"].data)[rows])
    out = dequantize(np.asarray(ta["output.weight"].data), ta["output.weight"].tensor_type)[rows]
    assert np.array_equal(np.asarray(tb["output.weight"].data).reshape(-1),
                          quantize(out, gguf.GGMLQuantizationType.Q4_0).reshape(-1))
    down = ta["blk.23.ffn_down.weight"]  # the last layer kept, as Q4_0 now
    assert tb["blk.1.ffn_down.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_0
    assert np.array_equal(np.asarray(tb["blk.1.ffn_down.weight"].data).reshape(-1),
                          quantize(dequantize(np.asarray(down.data), down.tensor_type),
                                   gguf.GGMLQuantizationType.Q4_0).reshape(-1))
    with pytest.raises(ValueError, match="vocab"):
        make_draft(src, tmp_path / "bad.gguf", keep=2, vocab=100)
    # Q3_K where rows are whole 256-blocks (ffn_down's 4864), the rest as it was (896 columns)
    q3 = {t.name: t for t in gguf.GGUFReader(make_draft(src, tmp_path / "q3.gguf", keep=2, vocab=4096,
                                                         weight_type="Q3_K")).tensors}
    assert q3["blk.0.ffn_down.weight"].tensor_type == gguf.GGMLQuantizationType.Q3_K
    assert q3["blk.0.attn_q.weight"].tensor_type == ta["blk.0.attn_q.weight"].tensor_type


def test_a_draft_of_fewer_tokens_keeps_the_greedy_text(tmp_path):
    """A draft cut to the first 16384 tokens reads the text in its own ids (a token it lacks as its
    first character) and drafts the target's ids; the greedy text is the text without drafts."""
    from stowlm.draftmodel import make_draft

    src = str(get_model("smollm2-135m"))
    draft = make_draft(src, tmp_path / "draft.gguf", vocab=16384)

    prompt = "The history of the Roman Empire began"
    with stowlm.LLM(src, n_ctx=1024, progress=False) as plain:
        want = plain.generate(prompt, max_tokens=60, temperature=0)
        drafter = Free(stowlm.LLM(str(draft), n_ctx=1024, progress=False))
        drafter.follow(plain)
        ids = drafter.to_target
        assert drafter.llm.model.n_vocab == len(ids) == 16384
        assert np.array_equal(drafter.to_draft[ids], np.arange(16384))
        lacking = next(i for i in range(16384, plain.model.n_vocab) if plain.tokenizer._tokens[i][:1] in
                       drafter.llm.tokenizer._token_to_id)
        first = plain.tokenizer._tokens[lacking][:1]
        assert drafter.llm.tokenizer._tokens[drafter.to_draft[lacking]] == first
    with stowlm.LLM(src, n_ctx=1024, progress=False, speculative=drafter, draft_max=4) as spec:
        got = spec.generate(prompt, max_tokens=60, temperature=0)
    # a shallow draft's acceptance moves with the kernels' rounding (AVX-512 machines: over 10 of
    # ~26; an AVX2-only AMD Zen 3: 8): that drafts were made and some kept is what is asserted
    assert got.tokens == want.tokens and got.drafted > 20 and got.accepted >= 5


def test_a_draft_model_with_prompt_lookup_keeps_the_greedy_text(tmp_path, monkeypatch):
    """With a draft model, prompt lookup drafts too (the default): text that repeats itself is
    drafted by the lookup, the rest by the model, both sources' drafts are checked and kept, and
    the greedy text is the text without drafts."""
    from stowlm import speculative
    from stowlm.draftmodel import make_draft

    src = str(get_model("smollm2-135m"))
    draft = make_draft(src, tmp_path / "draft.gguf", keep=30)
    prompt = ("def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n\n\n"
              "# the same two functions again:\ndef area(w, h):\n")
    with stowlm.LLM(src, n_ctx=1024, progress=False) as plain:
        want = plain.generate(prompt, max_tokens=60, temperature=0)
    sources = []
    record = speculative.Speculator.record

    def spy(self, drafted, accepted):
        sources.append((self.source, drafted, accepted))
        return record(self, drafted, accepted)

    monkeypatch.setattr(speculative.Speculator, "record", spy)
    drafter = Free(stowlm.LLM(str(draft), n_ctx=1024, progress=False), lookup=True)
    with stowlm.LLM(src, n_ctx=1024, progress=False, speculative=drafter, draft_max=4) as spec:
        got = spec.generate(prompt, max_tokens=60, temperature=0)
    drafter.llm.close()
    assert got.tokens == want.tokens
    kept = {}
    for src_, _, a in sources:
        kept[src_ == "model"] = kept.get(src_ == "model", 0) + a
    assert kept.get(False, 0) > 5 and kept.get(True, 0) > 0, sources  # lookups and the model both kept tokens
    assert got.drafted == sum(d for _, d, _ in sources) and got.accepted == sum(a for _, _, a in sources)
    with stowlm.LLM(src, n_ctx=1024, progress=False, speculative=str(draft)) as default, \
            stowlm.LLM(src, n_ctx=1024, progress=False, speculative=str(draft), draft_lookup=False) as alone:
        assert default._drafter.lookup is not None and alone._drafter.lookup is None
        assert alone.generate(prompt, max_tokens=30, temperature=0).tokens == want.tokens[:30]
    for spec in ("ngram", None):
        with pytest.raises(ValueError, match="draft_lookup=False needs a draft model"):
            stowlm.LLM(src, n_ctx=256, progress=False, speculative=spec, draft_lookup=False)
    cli = [sys.executable, "-m", "stowlm", "run", src, "-p", prompt, "-n", "30", "--temp", "0", "-c", "1024"]
    r = subprocess.run(cli + ["--spec", str(draft), "--no-draft-lookup"], capture_output=True, text=True,
                       env=subprocess_env(), timeout=300, stdin=subprocess.DEVNULL)
    with stowlm.LLM(src, n_ctx=1024, progress=False) as plain:
        assert r.returncode == 0 and r.stdout.startswith(prompt + plain.detokenize(want.tokens[:30])), r.stderr
    r = subprocess.run(cli + ["--no-draft-lookup"], capture_output=True, text=True, env=subprocess_env(), timeout=300,
                       stdin=subprocess.DEVNULL)
    assert r.returncode != 0 and "--no-draft-lookup needs --spec DRAFT" in r.stderr and "Traceback" not in r.stderr


def test_a_draft_model_drafts_the_length_that_yields_most_per_second():
    """A draft model's length maximises (tokens a pass yields) / (its cost + the draft steps), each
    step weighed by its timed share of a target step; a draft rarely kept, or dear, drafts none."""
    from stowlm.speculative import PassCosts, Speculator

    class Timed:
        cheap = False

        def __init__(self, seconds):
            self.seconds = seconds

    def best(rate, d, n_max=7):
        costs = PassCosts(repacked=True)
        costs.observe(1, 0.01)
        spec = Speculator(Timed(0.01 * d), n_max, costs)
        k = spec.length(rate)
        ratios = [(1 + sum(rate ** j for j in range(1, n + 1))) / (costs.cost(1 + n) + n * d) for n in range(n_max + 1)]
        return k, ratios

    for rate, d in [(0.95, 0.4), (0.9, 0.55), (0.8, 0.3), (0.99, 0.1)]:
        k, ratios = best(rate, d)
        assert k > 0 and ratios[k] == max(ratios), (rate, d, k, ratios)
    for rate, d in [(0.3, 0.5), (0.9, 1.2)]:
        assert best(rate, d)[0] == 0


class Stub:
    """A draft model's stand-in: every draft is k copies of one token, at `seconds` a step."""
    cheap = False

    def __init__(self, seconds):
        self.seconds, self.calls = seconds, 0

    def draft(self, history, k):
        self.calls += 1
        return [1] * k, "model"


def test_a_failing_draft_model_stops_for_the_request():
    """A draft model whose drafts all fail stops within a few drafts and drafts no more in that
    request, not even a probe (each would first read all the text since the stop); the next
    request starts from the prior again (its draft read the prompt: in step, no catch-up)."""
    from stowlm.speculative import PassCosts, Speculator

    costs = PassCosts(repacked=True)
    costs.observe(1, 0.01)
    stub = Stub(0.005)  # half a step
    spec = Speculator(stub, 7, costs)
    drafts = 0
    for _ in range(300):
        d = spec.draft([0] * 10, 7)
        if d:
            drafts += 1
            spec.record(len(d), 0)
    assert 1 <= drafts <= 6 and stub.calls == drafts
    assert spec.draft([0] * 10, 7) == []
    assert Speculator(stub, 7, costs).draft([0] * 10, 7) != []


def test_a_draft_model_learns_acceptance_per_position():
    """A draft whose first token is kept half the time but whose later ones always are (when the
    first is): the first position's estimate says so, the later ones' too, and the length built on
    them drafts several tokens where one rate of a draft token's average chance would draft fewer."""
    from stowlm.speculative import PassCosts, Speculator

    costs = PassCosts(repacked=True)
    costs.observe(1, 0.01)
    spec = Speculator(Stub(0.003), 7, costs)
    for i in range(200):
        assert spec.draft([0] * 10, 7)
        spec.record(4, 4 if i % 2 else 0)
    rates = spec.model_rates()
    assert 0.45 < rates[0] < 0.6 and min(rates[1:4]) > 0.85
    assert rates[4] == pytest.approx(spec.PRIOR["model"])  # never reached: the prior
    k = spec.length(rates)
    kept = spec.accepted / spec.drafted  # the share of drafted tokens kept: 0.5
    assert k >= 3 and spec.length(kept) < k


def test_a_step_is_timed_by_every_pass():
    """While drafts run no pass is of one token: a step's time comes from every pass, each divided
    by its cost in steps, so it follows the machine instead of keeping the first steps' time."""
    from stowlm.speculative import PassCosts

    costs = PassCosts(repacked=True)
    costs.observe(1, 0.030)  # a first step, graphs still being built
    for _ in range(60):
        costs.observe(4, 0.010 * costs.cost(4))
    assert costs.step_seconds() == pytest.approx(0.010, rel=0.02)


def test_a_draft_runs_while_the_draft_is_sure_of_it(tmp_path, monkeypatch):
    """A draft model's draft ends at the token where the product of the probabilities it gives its
    tokens falls below P_CHAIN (that token checked, not built on): above 1 every draft is one
    token, at 0 every draft is draft_max long (the budget allowing); the greedy text is the same."""
    from stowlm import speculative
    from stowlm.draftmodel import make_draft

    logits = np.array([2.0, 1.0, 0.0, -1.0], dtype=np.float32)
    p = np.exp(logits - logits.max())
    assert speculative._top_share(logits, 0) == pytest.approx(p[0] / p.sum())

    src = str(get_model("smollm2-135m"))
    draft = make_draft(src, tmp_path / "draft.gguf", keep=30)
    prompt = "The history of the Roman Empire began"
    with stowlm.LLM(src, n_ctx=1024, progress=False) as plain:
        want = plain.generate(prompt, max_tokens=40, temperature=0)

    class Sizes(Free):
        def draft(self, history, k):
            out = super().draft(history, k)
            sizes.append((k, len(out[0])))
            return out

    for chain, expect in [(1.01, lambda k: 1), (0.0, lambda k: k)]:
        sizes = []
        monkeypatch.setattr(speculative, "P_CHAIN", chain)
        drafter = Sizes(stowlm.LLM(str(draft), n_ctx=1024, progress=False))
        with stowlm.LLM(src, n_ctx=1024, progress=False, speculative=drafter, draft_max=4) as spec:
            got = spec.generate(prompt, max_tokens=40, temperature=0)
        drafter.llm.close()
        assert got.tokens == want.tokens and sizes and got.drafted == sum(n for _, n in sizes)
        assert all(n == expect(k) for k, n in sizes), (chain, sizes)
        assert any(k == 4 for k, _ in sizes)  # asked for draft_max: the length is the chain's


def test_a_draft_model_that_pays_drafts_up_to_draft_max():
    """Where the positions' acceptance says one draft token pays, the draft model is asked for
    draft_max (its confidence then ends the draft), within the budget; where none pays, for none."""
    from stowlm.speculative import PassCosts, Speculator

    costs = PassCosts(repacked=True)
    costs.observe(1, 0.01)
    asked = []

    class Asked(Stub):
        def draft(self, history, k):
            asked.append(k)
            return super().draft(history, k)

    spec = Speculator(Asked(0.004), 6, costs)
    assert spec.length(spec.model_rates()) >= 1
    assert len(spec.draft([0] * 10, 64)) == 6 and len(spec.draft([0] * 10, 3)) == 3
    assert asked == [6, 3]
    dear = Speculator(Asked(0.02), 6, costs)  # a draft step dearer than a target step
    assert dear.draft([0] * 10, 64) == [] and asked == [6, 3]


class Looked(Stub):
    """A draft model's stand-in with prompt lookup beside it, `behind` tokens of catch-up."""

    def __init__(self, seconds, catch_up=0.0, behind=0):
        super().__init__(seconds)
        self.lookup = NgramDrafter()
        self.catch_up_seconds, self._behind = catch_up, behind

    def behind(self, history):
        return self._behind


def test_a_draft_model_and_prompt_lookup_take_turns_by_what_each_yields():
    """Each step drafts from whichever yields more tokens per unit of time: a long n-gram match
    (no draft steps) over a dear model; a model that is cheap and sure over a one-token match
    rarely kept; and a model far behind the text (a catch-up of what the lookup drafted, at its
    timed cost per token) is not worth its catch-up where the lookup has nothing."""
    from stowlm.speculative import PassCosts, Speculator

    costs = PassCosts(repacked=True)
    costs.observe(1, 0.01)
    repeat = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14] * 2 + [5, 6, 7, 8]  # the last 4-gram came before
    dear = Looked(0.005)  # half a target step a draft token
    spec = Speculator(dear, 7, costs)
    got = spec.draft(repeat, 64)
    assert len(got) >= 3 and got == [9, 10, 11, 12, 13, 14, 5][:len(got)] and spec.source == 4 and dear.calls == 0

    cheap = Looked(0.0002)  # a 50th of a step
    spec = Speculator(cheap, 7, costs)
    spec.rates[1] = 0.1  # one-token matches: kept one time in ten
    unigram = [1, 2, 3, 4, 2]  # only the last token came before
    assert spec.draft(unigram, 64) == [1] * 7 and spec.source == "model" and cheap.calls == 1
    assert Speculator(dear, 7, costs).draft(unigram, 64) != [1] * 7  # a dear model: the lookup's token

    fresh = [1, 2, 3, 4, 99]  # no match at all
    near = Looked(0.003, catch_up=0.001, behind=2)
    assert Speculator(near, 7, costs).draft(fresh, 64) == [1] * 7
    far = Looked(0.003, catch_up=0.001, behind=20)  # 20 tokens at a tenth of a step each to read first
    assert Speculator(far, 7, costs).draft(fresh, 64) == [] and far.calls == 0


def test_the_draft_replay_counts_what_the_policy_would_yield():
    """bench/draft_replay.py's replay against hand counts: a draft sure and right everywhere drafts
    draft_max each pass (draft_max + 1 tokens for draft_max draft steps and a pass of draft_max + 1);
    one that doubts every token drafts one at a time; one always wrong stops within a few drafts."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import draft_replay
    finally:
        sys.path.remove(str(REPO / "bench"))
    from stowlm.speculative import PassCosts

    cost, n_max, n = 0.4, 4, 100  # 100 tokens: 20 passes of 4 drafts and the token after them
    sure = draft_replay.replay(np.ones(n), np.ones(n, bool), cost, n_max)
    first = PassCosts(repacked=True)
    assert sure == pytest.approx(n / (20 * (n_max * cost + first.cost(n_max + 1))), rel=1e-9)
    doubtful = draft_replay.replay(np.full(n, 0.5), np.ones(n, bool), cost, n_max)
    assert doubtful == pytest.approx(n / (n / 2 * (cost + first.cost(2))), rel=1e-9)
    wrong = draft_replay.replay(np.ones(n), np.zeros(n, bool), cost, n_max)
    assert 0.8 < wrong < 1.0


def test_drafts_weigh_the_kernels_that_run():
    """A pass's extra tokens cost what this CPU's kernels make them cost: with weights repacked,
    AVX-512's tiles take a few more tokens almost free and AVX2's do not, so at the same acceptance
    prompt lookup drafts fewer tokens on AVX2; an LLM takes the kernels of the path it runs."""
    from stowlm import ops
    from stowlm.speculative import NgramDrafter, PassCosts, Speculator

    def length(isa, rate):
        return Speculator(NgramDrafter(), 8, PassCosts(repacked=True, isa=isa)).length(rate)

    assert length("avx2", 0.5) < length("avx512", 0.5)
    assert length("avx2", 0.95) > 0 and length("avx512", 0.95) >= length("avx2", 0.95)
    if "avx2" not in ops.cpu_info()["supported"]:
        pytest.skip("this CPU/OS cannot run the avx2 path")
    best = ops.cpu_info()["best"]
    try:
        ops.set_isa("avx2")
        with stowlm.LLM(str(get_model("smollm2-135m")), n_ctx=256, progress=False) as llm:
            assert llm._pass_costs.isa == "avx2" and llm._pass_costs.repacked
            same = PassCosts(repacked=True, isa="avx2", attention=llm._pass_costs.attention)
            assert llm._pass_costs.cost(4) == same.cost(4) > PassCosts(repacked=True, attention=same.attention).cost(4)
    finally:
        ops.set_isa(best)


def test_stowlm_bench_spec_measures_a_prompt_file(tmp_path):
    """`stowlm bench --spec ngram --prompt-file F -o json`: a row per prompt with both rates, the
    drafts kept, and the same greedy answer with and without drafts (its length checked against
    an answer of plain LLM.chat here)."""
    import json
    import subprocess

    from conftest import subprocess_env

    path = get_model("smollm2-135m")
    count = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10. Continue the list: 1, 2,"
    prompts = [{"name": "count", "kind": "edit", "content": count}, "What is the capital of France?"]
    f = tmp_path / "prompts.json"
    f.write_text(json.dumps(prompts))
    r = subprocess.run([sys.executable, "-m", "stowlm", "bench", "-m", str(path), "--spec", "ngram", "--prompt-file",
                        str(f), "-n", "24", "-r", "1", "-t", "2", "-o", "json"], env=subprocess_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    rows = out["rows"]
    assert [row["name"] for row in rows] == ["count", "prompt 2"] and rows[1]["kind"] == "prompt"
    assert all(row["same"] for row in rows)
    assert rows[0]["drafted"] > 0 and 0 <= rows[0]["accepted"] <= rows[0]["drafted"]
    assert all(row["plain_median"] > 0 and row["spec_median"] > 0 for row in rows)
    with stowlm.LLM(str(path), n_ctx=4096, progress=False) as llm:
        for p, row in zip([count, prompts[1]], rows):
            c = llm.chat([{"role": "user", "content": p}], max_tokens=24, temperature=0)
            assert c.completion_tokens == row["tokens"]


def test_prompt_files_and_their_errors(tmp_path):
    from stowlm.specbench import load_prompts

    t = tmp_path / "p.txt"
    t.write_text("first prompt\nsecond line\n---\n\n---\nsecond prompt\n")
    assert [p["content"] for p in load_prompts(t)] == ["first prompt\nsecond line", "second prompt"]
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        load_prompts(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("\n---\n  \n")
    with pytest.raises(ValueError, match="empty.txt holds no prompt"):
        load_prompts(tmp_path / "empty.txt")
    (tmp_path / "obj.json").write_text('{"content": "x"}')
    with pytest.raises(ValueError, match="obj.json: expected a JSON list"):
        load_prompts(tmp_path / "obj.json")
    (tmp_path / "bad.json").write_text('[{"text": "x"}]')
    with pytest.raises(ValueError, match="bad.json: item 0"):
        load_prompts(tmp_path / "bad.json")
    from stowlm.cli.app import run_argv

    assert run_argv(["bench", "-m", "smollm2-135m", "--spec", "ngram", "--prompt-file", str(tmp_path / "nope.json")]) == 1


@functools.lru_cache(maxsize=None)
def _gguf_facts(path):
    """(its scalar metadata, [(tensor name, bytes)]) of a GGUF file, read with the gguf package."""
    import gguf

    r = gguf.GGUFReader(str(path))
    meta = {k: v.contents() for k, v in r.fields.items() if len(v.types) == 1 and k != "general.name"}
    return meta, [(t.name, int(t.n_bytes)) for t in r.tensors]


def _gguf_attention_oracle(path, n_kv):
    """A token's attention multiply-adds over n_kv cells from the file's own metadata, with
    Gemma 3's published layout: five sliding-window layers to one global."""
    f = _gguf_facts(path)[0]
    arch = f["general.architecture"]
    n_layer, n_head = f[f"{arch}.block_count"], f[f"{arch}.attention.head_count"]
    hd = f[f"{arch}.embedding_length"] // n_head
    dk, dv = f.get(f"{arch}.attention.key_length", hd), f.get(f"{arch}.attention.value_length", hd)
    window = f.get(f"{arch}.attention.sliding_window", 0) if arch == "gemma3" else 0
    cells = [min(n_kv, window) if window and il % 6 != 5 else n_kv for il in range(n_layer)]
    return float(sum(n_head * (dk + dv) * c for c in cells))


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m", "qwen3moe-tiny"])
def test_a_tokens_attention_and_weight_bytes_are_counted_from_the_model(name):
    """What a pass's cost model reads of the model: the weight bytes a token streams (the gguf
    package's tensor sizes: the input embedding a row only when an output matrix exists, an
    expert stack its used share) and the attention's multiply-adds at a depth (the file's heads
    and dims; Gemma 3's windowed layers stop growing at the window)."""
    from stowlm.engine import Model

    path = get_model(name)
    meta, tensors = _gguf_facts(path)
    arch = meta["general.architecture"]
    n_exp, used = meta.get(f"{arch}.expert_count", 0), meta.get(f"{arch}.expert_used_count", 0)
    untied = any(t == "output.weight" for t, _ in tensors)
    want = 0.0
    for t, nbytes in tensors:
        if t == "token_embd.weight" and untied:
            continue
        want += nbytes * (used / n_exp if n_exp and "_exps." in t else 1)
    m = Model(str(path))
    assert m.weight_bytes_per_token == pytest.approx(want, rel=1e-12)
    for n_kv in (1, 300, 4096):
        assert m.attention_macs(n_kv) == pytest.approx(_gguf_attention_oracle(path, n_kv), rel=1e-12)


def test_a_pass_costs_more_steps_deeper_in_the_context():
    """A pass's weights cost the same at any depth, its tokens' attention grows with the cells:
    in one-token steps at that depth a pass of 8 costs the tile model's 1.64 where it was measured
    (qwen2.5-coder-0.5b at depth 256) and more with every cell, most for the model whose attention
    is the larger share (smollm2 against qwen2.5-coder, the figures of speculative.py's fit);
    prompt lookup drafts shorter there at the same acceptance, and an LLM's costs are its model's."""
    from stowlm.speculative import (ATTN_BYTES_PER_MAC, STEP_ATTN, TILE_ATTN, NgramDrafter, PassCosts, Speculator,
                                    prior_cost)

    small, coder = get_model("smollm2-135m"), get_model("qwen2.5-coder-0.5b")
    costs = {}
    for name, path in (("smollm2", small), ("coder", coder)):
        with stowlm.LLM(str(path), n_ctx=256, progress=False) as llm:
            c = llm._pass_costs
            a = _gguf_attention_oracle(path, 4096) * ATTN_BYTES_PER_MAC / llm.model.weight_bytes_per_token
            weights = prior_cost(8, c.repacked, c.isa) * (1 + STEP_ATTN * TILE_ATTN) - 8 * TILE_ATTN
            assert c.cost(8, 4096) == pytest.approx((weights + 8 * a) / (1 + STEP_ATTN * a))
            assert c.cost(1, 4096) == 1.0
            costs[name] = c
    coder = costs["coder"]
    assert coder.cost(8, 256) == pytest.approx(prior_cost(8, coder.repacked, coder.isa), rel=1e-3)
    assert PassCosts(repacked=True).cost(8, 4096) == prior_cost(8, True)  # no model: the tile model
    for c in costs.values():
        assert c.cost(8, 0) < c.cost(8, 1024) < c.cost(8, 4096)
        assert c.cost(2, 4096) < c.cost(4, 4096) < c.cost(8, 4096)
    assert costs["smollm2"].cost(8, 4096) > costs["coder"].cost(8, 4096) > 2.0
    spec = Speculator(NgramDrafter(), 7, costs["smollm2"])
    spec.depth = 0
    shallow = spec.length(0.8)
    spec.depth = 4096
    deep = spec.length(0.8)
    assert 0 < deep < shallow
    # the step a pass's seconds say is the step at its depth
    c = PassCosts(repacked=True, attention=lambda d: d / 4096)
    c.observe(8, 0.05, depth=4096)
    assert c.step_seconds() == pytest.approx(0.05 / c.cost(8, 4096))
