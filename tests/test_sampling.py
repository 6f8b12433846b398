"""Sampler against a plain numpy transcription of llama.cpp's chain, statistical checks of the drawn
tokens, and the stop-string streamer."""
import math

import numpy as np
import pytest

from stowlm.text.sampling import Sampler, SamplingParams
from stowlm.text.stream import StopChecker


def softmax(v):
    v = np.asarray(v, dtype=np.float64)
    e = np.exp(v - v.max())
    return e / e.sum()


def ref_penalties(logits, history, rp, last_n, freq, pres):
    out = np.array(logits, dtype=np.float64)
    hist = list(history) if last_n == -1 else list(history)[-last_n:] if last_n > 0 else []
    counts = {}
    for t in hist:
        counts[t] = counts.get(t, 0) + 1
    for t, c in counts.items():
        out[t] = out[t] * rp if out[t] <= 0 else out[t] / rp
        out[t] -= c * freq + pres
    return out


def ref_chain(logits, p: SamplingParams, history=()):
    """The filtered distribution, written out step by step: {token: probability}."""
    x = ref_penalties(logits, history, p.repeat_penalty, p.repeat_last_n, p.frequency_penalty,
                      p.presence_penalty)
    for t, b in p.logit_bias.items():
        x[t] += b
    if p.temperature == 0:
        return {int(np.argmax(x)): 1.0}
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    if p.top_k > 0:
        order = order[:p.top_k]
    if p.typical_p < 1 and len(order) > 1:  # nearest the entropy first, until the mass passes typical_p
        pr = softmax(x[order])
        h = -sum(q * math.log(q) for q in pr)
        by = sorted(range(len(order)), key=lambda i: (abs(-math.log(pr[i]) - h), i))
        acc, kept = 0.0, []
        for i in by:
            kept.append(i)
            acc += pr[i]
            if acc > p.typical_p:
                break
        order = [order[i] for i in sorted(kept)]
    if p.top_p < 1:
        pr = softmax(x[order])
        acc = 0.0
        for n, q in enumerate(pr, 1):
            acc += q
            if acc >= p.top_p:
                break
        order = order[:n]
    if p.min_p > 0:
        pr = softmax(x[order])
        order = [t for t, q in zip(order, pr) if q >= p.min_p * pr.max() * (1 - 1e-12)]
    pr = softmax(x[order] / p.temperature)
    return dict(zip(order, pr))


def check_same(sampler, logits, history=()):
    ids, probs = sampler.candidates(logits, history)
    want = ref_chain(logits, sampler.params, history)
    assert set(ids.tolist()) == set(want), (sorted(ids.tolist()), sorted(want))
    for i, q in zip(ids.tolist(), probs.tolist()):
        assert q == pytest.approx(want[i], rel=1e-5, abs=1e-9)
    return ids, probs


def test_temperature_zero_is_argmax():
    rng = np.random.default_rng(0)
    for n in (2, 50, 262144):
        x = rng.normal(size=n).astype(np.float32) * 3
        for seed in (None, 1, 2):
            s = Sampler(SamplingParams(temperature=0, seed=seed))
            assert s.sample(x) == int(np.argmax(x))
            ids, probs = s.candidates(x)
            assert ids.tolist() == [int(np.argmax(x))] and probs.tolist() == [1.0]


def test_filters_match_reference():
    rng = np.random.default_rng(1)
    for trial in range(60):
        n = int(rng.integers(2, 400))
        x = (rng.normal(size=n) * rng.uniform(0.2, 5)).astype(np.float32)
        params = SamplingParams(temperature=float(rng.choice([0.3, 0.8, 1.0, 1.7])),
                                top_k=int(rng.choice([0, 1, 5, 40, n + 3])),
                                top_p=float(rng.choice([1.0, 0.95, 0.5, 0.1])),
                                min_p=float(rng.choice([0.0, 0.05, 0.3])))
        check_same(Sampler(params), x)


def test_top_k_of_a_large_vocabulary_matches_reference():
    """Top-k over a vocabulary's worth of logits, peaked (the best k near the largest: only those
    are partitioned), flat (all within reach), spread wider than Sampler._BEST_SPANS (fewer than k
    near the largest: the whole vocabulary), and with ties at the k-th value (lower ids kept)."""
    rng = np.random.default_rng(5)
    n = 49152
    peaked = (rng.normal(size=n) * 2).astype(np.float32)
    peaked[rng.choice(n, 60, replace=False)] += 12
    spread = np.full(n, -100.0, np.float32)
    spread[rng.choice(n, 30, replace=False)] = rng.uniform(-40, 0, 30).astype(np.float32)
    tied = np.round(rng.normal(size=n) * 2).astype(np.float32)
    for x in (peaked, (rng.normal(size=n) * 0.1).astype(np.float32), spread, tied):
        for k in (1, 40, 100):
            check_same(Sampler(SamplingParams(temperature=0.8, top_k=k, top_p=1.0, min_p=0.0)), x)


def test_top_k_top_p_min_p_exclude_exactly():
    x = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])).astype(np.float32)
    off = dict(top_k=0, top_p=1.0, min_p=0.0, temperature=1.0)
    ids, probs = Sampler(SamplingParams(**dict(off, top_k=3))).candidates(x)
    assert ids.tolist() == [0, 1, 2]
    np.testing.assert_allclose(probs, np.array([0.4, 0.25, 0.15]) / 0.8, rtol=1e-6)
    # top-p keeps the smallest prefix reaching p: 0.4 + 0.25 = 0.65 < 0.7 <= 0.8
    ids, _ = Sampler(SamplingParams(**dict(off, top_p=0.7))).candidates(x)
    assert ids.tolist() == [0, 1, 2]
    ids, _ = Sampler(SamplingParams(**dict(off, top_p=0.39))).candidates(x)
    assert ids.tolist() == [0]
    # min-p keeps p >= min_p * p_max: 0.3 * 0.4 = 0.12
    ids, _ = Sampler(SamplingParams(**dict(off, min_p=0.3))).candidates(x)
    assert ids.tolist() == [0, 1, 2]
    # temperature only reshapes what the filters left
    ids, probs = Sampler(SamplingParams(**dict(off, top_k=2, temperature=0.5))).candidates(x)
    np.testing.assert_allclose(probs, softmax(x[:2] / 0.5), rtol=1e-6)


def test_top_p_nucleus_prefetch_and_full_sort_agree():
    rng = np.random.default_rng(2)
    for scale in (8.0, 0.01):  # peaked: nucleus inside the prefetch; flat: needs the full sort
        x = (rng.normal(size=5000) * scale).astype(np.float32)
        s = Sampler(SamplingParams(top_k=0, top_p=0.9, min_p=0.0, temperature=1.0))
        ids, _ = check_same(s, x)
        if scale < 1:
            assert len(ids) > Sampler._NUCLEUS_PREFETCH


def test_sampled_frequencies_follow_filtered_distribution():
    x = np.log(np.array([0.3, 0.25, 0.2, 0.1, 0.08, 0.05, 0.02])).astype(np.float32)
    params = SamplingParams(temperature=0.9, top_k=5, top_p=0.85, min_p=0.2, seed=7)
    s = Sampler(params)
    want = ref_chain(x, params)
    n = 8000
    draws = np.array([s.sample(x) for _ in range(n)])
    assert set(np.unique(draws).tolist()) == set(want)  # support: exactly the kept tokens
    for t, q in want.items():
        freq = np.mean(draws == t)
        assert abs(freq - q) < 5 * math.sqrt(q * (1 - q) / n) + 1e-3, (t, freq, q)


def test_same_seed_same_sequence():
    rng = np.random.default_rng(3)
    logits = [rng.normal(size=1000).astype(np.float32) for _ in range(50)]
    p = SamplingParams(temperature=1.2, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    a = [Sampler(p).sample(x) for x in logits]  # fresh sampler per step: first draw of seed
    s1, s2 = Sampler(p), Sampler(p)
    seq1 = [s1.sample(x) for x in logits]
    seq2 = [s2.sample(x) for x in logits]
    assert seq1 == seq2
    s3 = Sampler(SamplingParams(temperature=1.2, top_k=0, top_p=1.0, min_p=0.0, seed=4321))
    assert [s3.sample(x) for x in logits] != seq1
    assert a == [Sampler(p).sample(x) for x in logits]


def test_penalties_match_reference():
    rng = np.random.default_rng(4)
    for trial in range(30):
        n = 300
        x = (rng.normal(size=n) * 3).astype(np.float32)
        hist = rng.integers(0, 40, size=int(rng.integers(0, 120))).tolist()
        p = SamplingParams(repeat_penalty=float(rng.choice([1.0, 1.1, 1.5])),
                           repeat_last_n=int(rng.choice([-1, 0, 8, 64])),
                           frequency_penalty=float(rng.choice([0.0, 0.3])),
                           presence_penalty=float(rng.choice([0.0, 0.7])),
                           temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
        s = Sampler(p)
        np.testing.assert_allclose(s.apply_penalties(x, hist),
                                   ref_penalties(x, hist, p.repeat_penalty, p.repeat_last_n,
                                                 p.frequency_penalty, p.presence_penalty),
                                   rtol=1e-6, atol=1e-5)
        check_same(s, x, hist)


def test_penalty_changes_greedy_choice():
    x = np.array([2.0, 1.9, -1.0, 0.5], dtype=np.float32)
    assert Sampler(SamplingParams(temperature=0)).sample(x, history=[0, 0]) == 0
    assert Sampler(SamplingParams(temperature=0, repeat_penalty=1.1)).sample(x, history=[0]) == 1
    # negative logits are multiplied: still lowered
    s = Sampler(SamplingParams(temperature=0, repeat_penalty=2.0))
    assert s.apply_penalties(x, [2])[2] == pytest.approx(-2.0)
    # outside the window: no effect
    s = Sampler(SamplingParams(temperature=0, repeat_penalty=1.5, repeat_last_n=2))
    assert s.sample(x, history=[0, 3, 3]) == 0


def test_logit_bias():
    x = np.array([3.0, 2.0, 1.0], dtype=np.float32)
    assert Sampler(SamplingParams(temperature=0, logit_bias={0: -math.inf})).sample(x) == 1
    assert Sampler(SamplingParams(temperature=0, logit_bias={2: 2.5})).sample(x) == 2
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, logit_bias={1: -math.inf}))
    ids, _ = s.candidates(x)
    assert 1 not in ids.tolist()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Sampler(SamplingParams(logit_bias={5: 1.0}), vocab_size=3)


@pytest.mark.parametrize("kwargs, allowed", [
    (dict(temperature=0), None), (dict(temperature=0.8), None), (dict(temperature=0, logit_bias={1: 5.0}), None),
    (dict(temperature=0.8, repeat_penalty=1.3), None), (dict(temperature=0), [True, False, True, True]),
])
def test_the_callers_logits_are_never_written(kwargs, allowed):
    """Without penalties the chain reads the caller's logits in place (no copy of a vocabulary a
    token); a bias, a penalty or a grammar's mask works on a copy."""
    x = np.array([3.0, 2.0, 1.0, 0.5], dtype=np.float32)
    before = x.copy()
    s = Sampler(SamplingParams(**kwargs))
    mask = None if allowed is None else np.array(allowed)
    ids, _ = s.candidates(x, history=[0, 0, 1], allowed=mask)
    np.testing.assert_array_equal(x, before)
    if allowed is not None:
        assert 1 not in ids.tolist()
    if kwargs.get("logit_bias"):
        assert ids.tolist() == [1]
    with pytest.raises(ValueError, match="NaN"):  # NaN found without a copy as well
        s.candidates(np.array([0.0, np.nan, 1.0, 2.0], dtype=np.float32))


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"), (dict(min_p=-0.1), "min_p"), (dict(min_p=2), "min_p"),
    (dict(repeat_penalty=0), "repeat_penalty"), (dict(repeat_last_n=-2), "repeat_last_n"),
    (dict(frequency_penalty=float("inf")), "frequency_penalty"), (dict(seed=-1), "seed"),
    (dict(max_tokens=0), "max_tokens"), (dict(stop=[""]), "stop"), (dict(stop=[3]), "stop"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias={1: float("nan")}), "logit_bias"),
    (dict(typical_p=0.0), "typical_p"), (dict(mirostat=3), "mirostat"), (dict(mirostat=True), "mirostat"),
    (dict(mirostat_tau=0), "mirostat_tau"), (dict(mirostat_eta=float("nan")), "mirostat_eta"),
])
def test_validation_names_the_bad_value(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_logits():
    s = Sampler(SamplingParams())
    with pytest.raises(ValueError, match="1-D"):
        s.sample(np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="NaN"):
        s.sample(np.array([0.0, np.nan], dtype=np.float32))
    with pytest.raises(ValueError, match="finite"):
        s.sample(np.array([-np.inf, -np.inf], dtype=np.float32))
    with pytest.raises(ValueError, match="entries"):
        Sampler(SamplingParams(), vocab_size=4).sample(np.zeros(3, dtype=np.float32))


# ------------------------------------------------------------------------------ stop strings

def run_stop(stop, pieces):
    sc = StopChecker(stop)
    emitted, history = "", []
    for p in pieces:
        out, stopped = sc.feed(p)
        emitted += out
        history.append(emitted)
        if stopped:
            return emitted, True, history
    emitted += sc.flush()
    history.append(emitted)
    return emitted, False, history


def test_stop_string_split_across_pieces():
    out, stopped, _ = run_stop(["</s>"], ["Hello <", "/", "s", "> world"])
    assert (out, stopped) == ("Hello ", True)
    out, stopped, _ = run_stop(["</s>"], ["a <", "/x", " b"])  # false start released
    assert (out, stopped) == ("a </x b", False)
    out, stopped, _ = run_stop(["\n\n", "User:"], ["Sure.\n", "Use", "r:", " hi"])
    assert (out, stopped) == ("Sure.\n", True)
    out, stopped, _ = run_stop(["abc", "bcd"], ["xab", "cd"])  # earliest match wins
    assert (out, stopped) == ("x", True)


def test_stop_random_splits_never_emit_partial_stop():
    rng = np.random.default_rng(5)
    alphabet = "ab<>/s \n"
    for _ in range(400):
        text = "".join(rng.choice(list(alphabet), size=int(rng.integers(0, 30))))
        stops = ["</s>", "\n\n", "abab"][: int(rng.integers(1, 4))]
        cuts = sorted(rng.choice(len(text) + 1, size=min(len(text), int(rng.integers(0, 8))), replace=False))
        pieces = [text[i:j] for i, j in zip([0] + list(cuts), list(cuts) + [len(text)])]
        hits = [text.find(s) for s in stops if s in text]
        want = text[:min(hits)] if hits else text
        out, stopped, history = run_stop(stops, pieces)
        assert out == want and stopped == bool(hits)
        # at every step what was emitted is a prefix of the final text: nothing of a stop string
        # was ever let out
        assert all(want.startswith(h) for h in history)


def test_stop_on_utf8_split_across_tokens():
    # the detokenizer and the stop checker together: emoji spread over byte-level tokens
    from _meta import read_metadata
    from conftest import get_model
    from stowlm.text.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(read_metadata(str(get_model("smollm2-135m"))), "smollm2-135m")
    text = "Emoji: 🤖🚀👍🏽 and flags 🇩🇪🇯🇵"
    ids = tok.encode(text, add_special=False)
    for stop, want in [("🚀", "Emoji: 🤖"), ("🏽 and", "Emoji: 🤖🚀👍"), ("🇯", "Emoji: 🤖🚀👍🏽 and flags 🇩🇪")]:
        det, sc = tok.detokenizer(), StopChecker([stop])
        emitted = ""
        for i in ids:
            out, stopped = sc.feed(det.feed(i))
            assert "\ufffd" not in out
            emitted += out
            assert want.startswith(emitted)
            if stopped:
                break
        assert stopped and emitted == want and sc.matched == stop


def test_text_stream_reasons_to_stop():
    from _meta import read_metadata
    from conftest import get_model
    from stowlm.text.stream import TextStream
    from stowlm.text.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(read_metadata(str(get_model("smollm2-135m"))), "smollm2-135m")
    ids = tok.encode("The answer is 4.\nUser: next", add_special=False)
    # a stop string
    ts = TextStream(tok, SamplingParams(stop=["\nUser:"]))
    out = "".join(ts.feed(i) for i in ids) + ts.close()
    assert out == "The answer is 4." and ts.finish_reason == "stop"
    # an end-of-generation token (<|im_end|>) ends it and is not shown
    ts = TextStream(tok, SamplingParams())
    out = "".join(ts.feed(i) for i in ids[:3] + [2] + ids[3:])
    assert out == tok.decode(ids[:3]) and ts.finished and ts.finish_reason == "stop"
    # max_tokens
    ts = TextStream(tok, SamplingParams(max_tokens=2))
    out = "".join(ts.feed(i) for i in ids)
    assert out == tok.decode(ids[:2]) and ts.finish_reason == "length" and ts.n_tokens == 2
    # nothing stops it: close() releases the held-back tail
    ts = TextStream(tok, SamplingParams(stop=["next!"], max_tokens=None))
    out = "".join(ts.feed(i) for i in ids)
    assert not ts.finished and out + ts.close() == tok.decode(ids) and ts.text == tok.decode(ids)


@pytest.mark.parametrize("kw", [dict(top_k=0, top_p=1.0, min_p=0.0, typical_p=0.5),
                                dict(top_k=20, top_p=1.0, min_p=0.0, typical_p=0.7),
                                dict(top_k=0, top_p=0.9, min_p=0.02, typical_p=0.8, temperature=0.7),
                                dict(top_k=40, top_p=0.95, min_p=0.05, typical_p=0.3)])
def test_typical_p_matches_reference(kw):
    """Locally typical sampling (after top-k, before top-p, as in llama.cpp's chain) against the
    loop written out in ref_chain, over peaked and flat logits."""
    rng = np.random.default_rng(5)
    for scale in (0.5, 2.0, 6.0):
        check_same(Sampler(SamplingParams(**kw)), (rng.standard_normal(300) * scale).astype(np.float32))


def ref_mirostat(logits, p: SamplingParams, steps: int, seed: int, n_vocab: int):
    """Mirostat 1 or 2 written out from its paper's and llama.cpp's rules: the tokens drawn and mu."""
    rng = np.random.default_rng(seed)
    mu, out = 2 * p.mirostat_tau, []
    x = np.asarray(logits, dtype=np.float64) / p.temperature
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    pr = softmax(x[order])
    for _ in range(steps):
        if p.mirostat == 2:
            keep = max(1, sum(1 for q in pr if -math.log2(q) <= mu))
        else:
            m = min(100, len(pr))
            num = sum(math.log((i + 2) / (i + 1)) * math.log(pr[i] / pr[i + 1]) for i in range(m - 1))
            den = sum(math.log((i + 2) / (i + 1)) ** 2 for i in range(m - 1))
            s_hat = num / den
            eps = s_hat - 1
            k = (eps * 2 ** mu / (1 - n_vocab ** -eps)) ** (1 / s_hat)
            keep = min(len(pr), max(1, int(k)))
        q = pr[:keep] / pr[:keep].sum()
        if keep == 1:
            i = 0
        else:
            cum = np.cumsum(q)
            i = min(int(np.searchsorted(cum, rng.random() * cum[-1], side="right")), keep - 1)
        out.append(order[i])
        mu -= p.mirostat_eta * (-math.log2(q[i]) - p.mirostat_tau)
    return out, mu


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_matches_reference(version):
    """Mirostat's cut at the running surprise limit mu and mu's update after every token: the same
    tokens and the same mu as the rules written out, from peaked to flat distributions."""
    rng = np.random.default_rng(11)
    for scale, tau in ((1.0, 3.0), (3.0, 1.5), (0.3, 6.0)):
        logits = (rng.standard_normal(500) * scale).astype(np.float32)
        p = SamplingParams(temperature=0.8, mirostat=version, mirostat_tau=tau, mirostat_eta=0.2, seed=4)
        s = Sampler(p, vocab_size=500)
        got = [s.sample(logits) for _ in range(40)]
        want, mu = ref_mirostat(logits, p, 40, 4, 500)
        assert got == want and s.mu == pytest.approx(mu, rel=1e-9)
        ids, probs = Sampler(p, vocab_size=500).candidates(logits)  # mu = 2 tau: the first cut
        assert ids[0] == int(np.argmax(logits)) and probs.sum() == pytest.approx(1.0)


def test_mirostat_steers_the_surprise_to_its_target():
    """What Mirostat is for: the observed surprise of the tokens drawn averages near tau, where a
    plain sampler's follows the distribution (flat logits: far above)."""
    logits = (np.random.default_rng(2).standard_normal(2000) * 0.5).astype(np.float32)
    for tau in (2.0, 4.0):
        s = Sampler(SamplingParams(temperature=1.0, mirostat=2, mirostat_tau=tau, mirostat_eta=0.1, seed=9))
        lp = np.log2(softmax(logits))
        surprise = []
        for _ in range(400):
            ids, probs = s.candidates(logits)
            t = s.sample(logits)
            surprise.append(-math.log2(probs[list(ids).index(t)]))
        assert abs(np.mean(surprise[100:]) - tau) < 0.5
        assert -np.mean(lp) > tau + 3  # unsteered, the typical token is far more surprising
