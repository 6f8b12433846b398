"""Several sequences in one context and the continuous-batching engine on top of it.

Oracles: the same request alone (greedy text and logits must be bit-identical among other
requests), a one-sequence context (the same numbers up to rounding), and the requests' own
token counts."""
import threading

import numpy as np
import pytest

import stowlm
from stowlm.batching import Event
from stowlm.engine import Context, Model
from stowlm.ops import cpu_info
from stowlm.text.sampling import SamplingParams

from conftest import get_model

PROMPTS = ["The capital of France is", "Once upon a time", "def fib(n):", "The three primary colors are",
           "In 1492,", "Water boils at"]


def _kl(a, b):
    pa = np.exp(a - a.max()); pa /= pa.sum()
    pb = np.exp(b - b.max()); pb /= pb.sum()
    return float((pa * (np.log(pa + 1e-30) - np.log(pb + 1e-30))).sum())


@pytest.mark.parametrize("name,kv_type", [("smollm2-135m", "f16"), ("smollm2-135m", "q8_0"), ("gemma3-270m", "f16"),
                                          ("qwen2.5-coder-0.5b", "q8_0"), ("smollm2-moe", "f16"),
                                          ("qwen3moe-tiny", "f16")])
def test_a_token_gets_the_same_logits_alone_and_among_other_sequences(name, kv_type):
    model = Model(str(get_model(name)))
    ctx = Context(model, n_ctx=2048, n_seq=4, n_ubatch=64, kv_type=kv_type)
    rng = np.random.default_rng(1)
    prompts = [list(map(int, rng.integers(10, 5000, n))) for n in (37, 80, 5, 130)]

    def fill(seqs):
        ctx.clear()
        for s in seqs:
            ctx.eval_batch(prompts[s], [s] * len(prompts[s]))

    fill([0])
    alone = ctx.eval_batch([42], [0])[0]
    fill([3, 1, 0, 2])  # other sequences' cells taken first, in another order
    together = ctx.eval_batch([7, 42, 9, 11], [3, 0, 1, 2], rows=[0, 1, 2, 3])
    assert np.array_equal(together[1], alone)
    # and the prompt of a sequence evaluated while the others hold tokens
    fill([1, 2])
    ctx.eval_batch(prompts[0], [0] * len(prompts[0]))
    assert np.array_equal(ctx.eval_batch([42], [0])[0], alone)

    # the same numbers as a context of one sequence, up to rounding (other KV splits), for the
    # sequences of the first and the last region
    one = Context(model, n_ctx=512, n_ubatch=64, kv_type=kv_type)
    for seq, tok, got in ((0, 42, alone), (3, 7, together[0])):
        one.clear()
        one.eval(prompts[seq])
        ref = one.eval([tok])
        assert _kl(ref, got) < 2e-3 and int(ref.argmax()) == int(got.argmax()), seq


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"])
def test_a_prompts_tail_forced_onto_the_batched_kernels_gets_the_bits_of_its_chunk(name):
    """eval_batch(batched=True): a tail of any length after a cached prefix gives the last token the
    logits evaluating the whole prompt in one pass gives (on the other kernels it would not), in a
    context of one sequence and in another sequence's region, for both KV cache types. The prompt
    reaches the largest batch bound (with repacked weights 256 tokens: below it their products keep
    the row kernels), where a pass takes the kernels a forced one does."""
    model = Model(str(get_model(name)))
    rng = np.random.default_rng(5)
    n = max([47] + [b + 10 for b in model.batch_bounds])
    ids = list(map(int, rng.integers(10, 5000, n)))
    for n_seq, kv_type in ((1, "f16"), (4, "f16"), (1, "q8_0"), (4, "q8_0")):
        ctx = Context(model, n_ctx=512 * n_seq, n_seq=n_seq, n_ubatch=512, kv_type=kv_type)
        assert ctx.can_force_batched
        seq = n_seq - 1

        def run(cuts, batched):
            ctx.clear(seq)
            b = 0
            for e in cuts:
                out = ctx.eval_batch(ids[b:e], [seq] * (e - b), rows=[e - b - 1], batched=batched)[0]
                b = e
            return out

        whole = run([n], False)
        for cuts in ([n - 10, n], [n - 1, n], [5, 30, n], [1, n]):
            assert np.array_equal(run(cuts, True), whole), (name, n_seq, kv_type, cuts)
        if cpu_info()["active"] != "scalar":  # (the scalar path has no batched kernels)
            assert not np.array_equal(run([n - 10, n], False), whole)  # ten tokens on the row kernels differ
    small = Context(model, n_ctx=256, n_ubatch=16)
    assert not small.can_force_batched
    with pytest.raises(ValueError, match="batched passes need"):
        small.eval_batch([1, 2, 3], [0, 0, 0], batched=True)


def test_sequences_are_isolated_truncated_and_bounded():
    model = Model(str(get_model("smollm2-135m")))
    ctx = Context(model, n_ctx=1024, n_seq=4)
    assert ctx.n_ctx == 1024 and ctx.n_seq == 4
    a, b = [1, 100, 200, 300, 400], [1, 500, 600]
    ctx.eval_batch(a + b, [0] * 5 + [1] * 3)
    assert (ctx.n_past_of(0), ctx.n_past_of(1), ctx.n_past_of(2)) == (5, 3, 0)
    want = ctx.eval_batch([7], [1])[0]
    # truncating sequence 1 and evaluating again gives the same; sequence 0 is untouched
    ctx.kv_truncate(3, seq=1)
    assert np.array_equal(ctx.eval_batch([7], [1])[0], want)
    assert ctx.n_past_of(0) == 5
    ctx.clear(0)
    assert ctx.n_past_of(0) == 0 and ctx.n_past_of(1) == 4
    # a sequence owns n_ctx / n_seq cells: the 257th token of one is refused, naming the sizes
    ctx.clear()
    ctx.eval_batch([5] * 256, [2] * 256)
    with pytest.raises(ValueError, match=r"257 cells.*sequence 2.*256"):
        ctx.eval_batch([5], [2])
    assert ctx.n_past_of(2) == 256  # the failed call changed nothing
    ctx.eval_batch([5] * 256, [3] * 256)  # the other regions are still free
    with pytest.raises(ValueError, match="outside"):
        ctx.eval_batch([5], [4])
    with pytest.raises(ValueError, match="multiple of n_seq"):
        Context(model, n_ctx=1000, n_seq=3)


def test_a_sequence_holds_the_regions_of_idle_ones_after_it():
    """kv_span: sequence 1 takes regions 2 and 3 (which must be empty), holds up to 768 cells, its
    tokens get the same logits whether or not others run beside it, and gives them back."""
    model = Model(str(get_model("smollm2-135m")))
    ctx = Context(model, n_ctx=1024, n_seq=4, n_ubatch=512)
    long = [int(t) for t in np.random.default_rng(2).integers(10, 5000, 600)]
    ctx.eval_batch([5] * 10, [3] * 10)
    with pytest.raises(ValueError, match="sequence 3 holds tokens"):
        ctx.kv_span(1, 3)
    ctx.clear(3)
    ctx.kv_span(1, 3)
    assert ctx.capacity(1) == 768 and ctx.kv_span_of(1) == 3
    with pytest.raises(ValueError, match="held by sequence 1"):
        ctx.eval_batch([5], [2])
    with pytest.raises(ValueError, match="held by sequence 1"):
        ctx.kv_span(2, 1)
    alone = ctx.eval_batch(long, [1] * 600, rows=list(range(0, 600, 50)))
    step_alone = ctx.eval_batch([9], [1])[0]
    ctx.clear()
    assert ctx.kv_span_of(1) == 1  # a cache cleared whole gives the regions back
    ctx.kv_span(1, 3)
    ctx.eval_batch([7] * 40, [0] * 40)  # a neighbour at work before and during
    among = ctx.eval_batch(long + [3, 4], [1] * 600 + [0, 0], rows=list(range(0, 600, 50)))
    step_among = ctx.eval_batch([9, 8], [1, 0], rows=[0])[0]
    assert np.array_equal(alone, among) and np.array_equal(step_alone, step_among)
    with pytest.raises(ValueError, match=r"769 cells.*768"):
        ctx.eval_batch([5] * 168, [1] * 168)
    with pytest.raises(ValueError, match="more than 256 cells"):
        ctx.kv_span(1, 1)  # 601 tokens do not fit its own region
    ctx.kv_truncate(200, seq=1)
    ctx.kv_span(1, 1)
    ctx.eval_batch([5] * 10, [2] * 10)  # region 2 is its own again
    # its logits are a one-sequence context's up to rounding (fixed splits differ)
    one = Context(model, n_ctx=1024).eval(long, logits="all")[list(range(0, 600, 50))]
    assert max(_kl(x, y) for x, y in zip(one, alone)) < 1e-3


def test_a_long_request_takes_the_cells_idle_slots_leave(served):
    """Past one slot's 512 cells: the prompt takes the regions of idle slots after its own (a
    generation that outgrows them takes the next idle one), with the same text alone and among
    other requests; past n_ctx it is refused."""
    long = "The history of computing, told slowly. " * 70  # ~560 tokens
    want = served.generate(long, max_tokens=30, temperature=0)
    assert want.prompt_tokens > 512 and want.completion_tokens == 30
    runs = [served.generate(p, max_tokens=20, temperature=0, stream=True) for p in PROMPTS[:2]]
    runs.append(served.generate(long, max_tokens=30, temperature=0, stream=True))
    for r in runs:
        for _ in r:
            pass
    assert runs[-1].completion.tokens == want.tokens
    grown = served.generate("Count: 1, 2, 3,", max_tokens=700, temperature=0)
    assert grown.completion_tokens == 700 and grown.finish_reason == "length"
    # every slot busy: the long request waits its turn, then runs
    busy = [served.generate(p, max_tokens=60, temperature=0, stream=True) for p in PROMPTS[:4]]
    late = served.generate(long, max_tokens=30, temperature=0, stream=True)
    for r in busy + [late]:
        for _ in r:
            pass
    assert late.completion.tokens == want.tokens


@pytest.fixture(scope="module")
def served():
    with stowlm.LLM(str(get_model("smollm2-135m")), n_ctx=4 * 512, n_seq=4, progress=False) as llm:
        yield llm


def test_generate_batch_equals_one_at_a_time(served):
    got = served.generate_batch(PROMPTS, max_tokens=24, temperature=0)
    alone = [served.generate(p, max_tokens=24, temperature=0) for p in PROMPTS]
    assert [c.text for c in got] == [c.text for c in alone]
    assert all(c.completion_tokens == 24 and c.finish_reason == "length" for c in got)


def test_concurrent_threads_get_their_own_answers(served):
    want = {p: served.generate(p, max_tokens=16, temperature=0).text for p in PROMPTS[:4]}
    out = {}

    def run(p):
        out[p] = "".join(served.generate(p, max_tokens=16, temperature=0, stream=True))

    threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS[:4] * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == want


def test_a_follow_up_reuses_the_slot_cache(served):
    eng = served._engine
    long_prompt = served.tokenize("Tell me a story. " * 60)  # more than one chunk
    assert len(long_prompt) > eng.chunk
    first = served.generate(long_prompt, max_tokens=8, temperature=0)
    before = eng.stats()["prompt_tokens_evaluated"]
    follow = long_prompt + first.tokens + served.tokenize(" And then?", add_special=False)
    again = served.generate(follow, max_tokens=8, temperature=0)
    evaluated = eng.stats()["prompt_tokens_evaluated"] - before
    # the follow-up's last chunk (past 256) is large enough for the batched kernels, which the
    # long prompt's tail used too: the whole prompt is reused, and the new tokens go in a pass
    # forced onto the batched kernels where its class is the largest passes' (CPU devices), else
    # in the smallest pass of its class (repacked weights: 24-255 tokens keep the row kernels)
    assert eng.reuse.forced and eng.reuse.kernels(len(follow) - 256) >= 1
    assert evaluated == _tail(eng, len(follow) - 256, len(long_prompt) - 256)
    # the reused cache gives the text a fresh slot gives
    _forget(served)
    assert served.generate(follow, max_tokens=8, temperature=0).text == again.text


def _forget(llm):
    for s in llm._engine.slots:
        s.cached, s.kernels = [], []
        llm.ctx.clear(s.index)


def _logprobs(eng, tokens, n=6):
    """Greedy tokens with their top-5 log-probabilities, and the prompt tokens evaluated."""
    out, done = [], threading.Event()
    before = eng.stats()["prompt_tokens_evaluated"]

    def on_event(ev: Event):
        if ev.kind == "piece" and ev.token is not None:
            out.append((ev.token, ev.logprob, tuple(ev.top_logprobs)))
        elif ev.kind == "done":
            done.set()

    eng.submit(tokens, SamplingParams(temperature=0, max_tokens=n), on_event, logprobs=5)
    assert done.wait(60)
    return out, eng.stats()["prompt_tokens_evaluated"] - before


def test_a_shared_prefix_is_reused_mid_chunk_with_the_bits_of_a_fresh_slot(served):
    """Prompts sharing a system prompt reuse it wherever the kernels allow, not only at chunk
    boundaries, and every generated token's log-probabilities are bit-identical to a fresh slot's."""
    eng = served._engine
    system = served.tokenize("You are a careful assistant who answers in one short sentence. " * 3)
    cats = system + served.tokenize(" Tell me about cats.", add_special=False)
    longer = system + served.tokenize(" Tell me about dogs, and why they bark at night so often.", add_special=False)
    short = cats[:eng.bounds[0] - 4]  # a prompt on the row kernels: the cached batched tokens don't fit it
    assert len(system) > eng.bounds[0] and len(longer) < eng.chunk
    fresh = {}
    for name, toks in (("longer", longer), ("short", short), ("cats", cats)):
        _forget(served)
        fresh[name], n = _logprobs(eng, toks)
        assert n == len(toks)
    _forget(served)
    _logprobs(eng, cats)
    got, n = _logprobs(eng, longer)
    assert got == fresh["longer"]
    # the whole common prefix is kept, the rest forced onto the batched kernels where the prompt's
    # pass would take the largest passes' kernels; else (repacked weights keep the row kernels
    # below 256 tokens) the pass is extended back to the smallest of its class
    common = len(system) + 3
    assert longer[:common] == cats[:common] and longer[common] != cats[common]
    assert eng.reuse.forced and n == _tail(eng, len(longer), common)
    got, n = _logprobs(eng, short)  # to an empty slot: 'longer' stays cached
    assert got == fresh["short"] and n == len(short)
    got, n = _logprobs(eng, cats)
    assert got == fresh["cats"] and n == _tail(eng, len(cats), common)


def _tail(eng, n, common):
    """Tokens a prompt of n tokens (within one chunk) evaluates after `common` cached ones: those
    past them, forced onto the batched kernels where a fresh pass of n takes the largest passes'
    kernels, else at least the smallest pass of n's kernel class."""
    cls = eng.reuse.kernels(n)
    return n - common if cls == len(eng.bounds) else max(n - common, eng.bounds[cls - 1])


def test_engine_errors_cancel_and_queue(served):
    eng = served._engine
    with pytest.raises(ValueError, match=r"2100 tokens.*2048"):
        served.generate([1] * 2100, max_tokens=1)
    with pytest.raises(ValueError, match="temperature"):
        served.generate("x", temperature=-1)
    # a cancelled request ends with finish_reason "cancelled" and frees its slot
    events = []
    done = threading.Event()

    def on_event(ev: Event):
        events.append(ev)
        if ev.kind == "done":
            done.set()
        elif len(events) == 3:
            eng.cancel(req)

    req = eng.submit(served.tokenize("Count: 1, 2, 3,"), SamplingParams(temperature=0, max_tokens=200), on_event)
    assert done.wait(60)
    assert events[-1].finish_reason == "cancelled" and events[-1].completion_tokens < 200
    assert eng.stats()["slots_busy"] == 0
    # the engine still serves
    assert served.generate("The capital of France is", max_tokens=4, temperature=0).completion_tokens == 4


def test_a_script_that_never_closes_its_engine_exits_cleanly():
    """The engine thread holds the model: at exit it is stopped first, so a script that just ends
    prints its text and nothing else (nanobind reported the model as leaked before)."""
    import subprocess
    import sys

    from conftest import subprocess_env

    script = ("import stowlm\n"
              f"llm = stowlm.LLM({str(get_model('smollm2-135m'))!r}, n_seq=2, progress=False)\n"
              "print(len(llm.generate_batch(['Hi', 'Why is the sky blue?'], max_tokens=3, temperature=0)))\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=subprocess_env(),
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "2", (r.stdout, r.stderr)
    assert "leak" not in r.stderr, r.stderr


def test_without_forced_passes_a_tail_is_extended_to_the_smallest_batched_pass(served):
    """Where the batched kernels cannot be forced (CUDA devices), the pass after a reused prefix is
    extended back to the smallest that takes them: fewer tokens reused, the same bits."""
    eng = served._engine
    system = served.tokenize("You are a careful assistant who answers in one short sentence. " * 3)
    cats = system + served.tokenize(" Tell me about cats.", add_special=False)
    longer = system + served.tokenize(" Tell me about dogs, and why they bark at night so often.", add_special=False)
    _forget(served)
    fresh, _ = _logprobs(eng, longer)
    eng.reuse.forced = False
    try:
        _forget(served)
        _logprobs(eng, cats)
        got, n = _logprobs(eng, longer)
    finally:
        eng.reuse.forced = served.ctx.can_force_batched
    common = len(system) + 3
    assert got == fresh and n == max(len(longer) - common, eng.bounds[0]) < len(longer)


def test_with_routed_experts_a_prefix_is_reused_at_whole_chunks():
    """An expert's kernels follow how many tokens of a pass picked it, so a pass that starts
    mid-chunk could change a token's bits: an MoE model reuses whole chunks only."""
    with stowlm.LLM(str(get_model("qwen3moe-tiny")), n_ctx=2 * 256, n_seq=2, n_ubatch=64, progress=False) as llm:
        eng = llm.engine()
        assert eng.reuse.whole_chunks and eng.chunk == 64
        rng = np.random.default_rng(3)
        a = list(map(int, rng.integers(10, 1000, 100)))
        b = a[:90] + list(map(int, rng.integers(10, 1000, 20)))
        fresh, n = _logprobs(eng, b)
        assert n == len(b)
        _forget(llm)
        _logprobs(eng, a)
        got, n = _logprobs(eng, b)
        assert got == fresh and n == len(b) - 64
