"""The user API (stowlm.LLM) and the stowlm CLI on a real model (smollm2-135m)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import stowlm
from conftest import get_model, load_fixture, subprocess_env


@pytest.fixture(scope="module")
def llm():
    with stowlm.LLM(str(get_model("smollm2-135m")), n_ctx=512, progress=False) as m:
        yield m


def test_temperature_zero_is_the_engine_greedy_loop(llm):
    """generate(temperature=0) equals a hand-written argmax loop over the low-level Context
    (agreement with llama.cpp's own greedy run is tested in test_models.py)."""
    rec = next(r for r in load_fixture("smollm2-135m") if r["kind"] == "logits")
    out = llm.generate(rec["ids"], max_tokens=12, temperature=0.0)
    ctx = stowlm.Context(llm.model, n_ctx=512)
    logits = ctx.eval(rec["ids"])
    want = []
    for _ in range(12):
        tok = int(np.argmax(logits))
        if llm.tokenizer.is_eog(tok):
            break
        want.append(tok)
        logits = ctx.eval([tok])
    assert out.tokens == want
    assert out.prompt_tokens == len(rec["ids"]) and out.completion_tokens == len(want)
    assert out.finish_reason == ("length" if len(want) == 12 else "stop")


@pytest.mark.parametrize("n_ubatch", [64, 512])
def test_a_reused_prefix_gives_the_bits_of_a_fresh_evaluation(n_ubatch):
    """Whatever the cache held before (a shorter prompt ending inside or past a chunk, the same
    prompt, a generation followed by a turn that quotes it, logits()), a prompt's last logits are
    the bits of evaluating it afresh, and the cache is still reused where that allows."""
    with stowlm.LLM(str(get_model("smollm2-135m")), n_ctx=512, n_ubatch=n_ubatch, progress=False) as m:
        p = m.tokenize("Once upon a time, in a village by the sea, there lived an old fisherman who "
                       "told stories every evening. " * 5)
        assert len(p) > 100
        evaluated = []
        eval_, eval_batch = m.ctx.eval, m.ctx.eval_batch
        m.ctx.eval = lambda toks, *a, **k: evaluated.append(len(toks)) or eval_(toks, *a, **k)
        m.ctx.eval_batch = lambda toks, *a, **k: evaluated.append(len(toks)) or eval_batch(toks, *a, **k)

        def fresh(toks):
            m._rewind(0)
            return m._prefill(toks).copy()

        def after(prepare, toks):
            m._rewind(0)
            prepare()
            del evaluated[:]
            return m._prefill(toks).copy(), sum(evaluated)

        gen = m.generate(p[:50], max_tokens=8, temperature=0).tokens
        turn = p[:50] + gen + p[50:80]
        cases = [(lambda: m._prefill(p), p), (lambda: m.logits(p[:70]), p),
                 (lambda: m.generate(p[:50], max_tokens=8, temperature=0), turn)]
        cases += [(lambda n=n: m._prefill(p[:n]), p) for n in (10, 23, 30, 63, 64, 70, 100)]
        cases += [(lambda: m._prefill(p), p[:90])]
        reused = 0
        for prepare, toks in cases:
            got, n_eval = after(prepare, toks)
            assert np.array_equal(got, fresh(toks)), (len(toks), n_eval)
            reused += n_eval < len(toks)
        assert reused >= 6, "the cache was hardly reused"


def test_same_seed_same_text_and_stream_equals_whole(llm):
    kw = dict(max_tokens=12, temperature=0.9, seed=1234)
    one = llm.generate("Once upon a time", **kw)
    two = llm.generate("Once upon a time", **kw)
    assert one.text == two.text and one.tokens == two.tokens
    pieces = list(llm.generate("Once upon a time", stream=True, **kw))
    assert "".join(pieces) == one.text


def test_stop_string_ends_the_text(llm):
    full = llm.generate("1, 2, 3, 4,", max_tokens=12, temperature=0)
    assert "6" in full.text, full.text
    cut = llm.generate("1, 2, 3, 4,", max_tokens=12, temperature=0, stop=["6"])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[:full.text.index("6")]


def test_chat_uses_the_template(llm):
    out = llm.chat([{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0)
    assert out.completion_tokens > 0 and out.text.strip()


def test_bad_inputs_raise_and_the_llm_stays_usable(llm):
    with pytest.raises(ValueError, match="n_ctx=512"):
        llm.generate([1] * 600, max_tokens=1)
    with pytest.raises(ValueError, match="temperature"):
        llm.generate("hi", temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        llm.generate("hi", top_p=1.5)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([10 ** 7], max_tokens=1)
    assert llm.generate("Hello", max_tokens=2, temperature=0).completion_tokens >= 1


def test_missing_and_non_gguf_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        stowlm.LLM(str(tmp_path / "nope.gguf"), progress=False)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="junk.gguf"):
        stowlm.LLM(str(junk), progress=False)


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "stowlm", *args], capture_output=True, text=True,
                          timeout=timeout, env=subprocess_env(), stdin=subprocess.DEVNULL)


def test_cli_run_prints_a_completion():
    r = _cli("run", str(get_model("smollm2-135m")), "-p", "The capital of France is", "-n", "8", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The capital of France is")
    assert len(r.stdout.strip()) > len("The capital of France is")
    assert "tokens/s" in r.stderr


def test_cli_errors_are_clear():
    r = _cli("run", "/no/such/model.gguf", "-p", "x")
    assert r.returncode != 0 and "model.gguf" in r.stderr and "Traceback" not in r.stderr
    r = _cli("pull", "no-such-model")
    assert r.returncode != 0 and "smollm2-135m" in r.stderr  # lists the known names
    r = _cli("run", str(get_model("smollm2-135m")), "-p", "x", "--top-p", "7")
    assert r.returncode != 0 and "top_p" in r.stderr and "Traceback" not in r.stderr


def test_cli_info_version_help():
    r = _cli("info", str(get_model("smollm2-135m")))
    assert r.returncode == 0, r.stderr
    assert "llama" in r.stdout and "Q4_1" in r.stdout
    r = _cli("--version")
    assert r.returncode == 0 and stowlm.__version__ in r.stdout
    r = _cli("--help")
    assert r.returncode == 0 and "run" in r.stdout and "pull" in r.stdout


def test_cli_takes_dash_m_and_structured_output_flags(tmp_path):
    """llama.cpp users type -m MODEL; the positional MODEL and -m are the same, two different ones
    are refused. run --json-schema / --grammar-file constrain the text; bad files are named."""
    path = str(get_model("smollm2-135m"))
    a = _cli("info", path)
    b = _cli("info", "-m", path)
    assert b.returncode == 0 and b.stdout == a.stdout
    r = _cli("run", path, "-m", "other-model", "-p", "x")
    assert r.returncode != 0 and "two models" in r.stderr
    r = _cli("fit", "-m", path, "--json")
    assert r.returncode == 0 and '"n_ctx"' in r.stdout
    pytest.importorskip("llguidance")
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}')
    r = _cli("run", "-m", path, "-p", "Is water wet? JSON:", "--json-schema", str(schema), "--temp", "0", "-q")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout[len("Is water wet? JSON:"):])["answer"] in ("yes", "no")
    gbnf = tmp_path / "g.gbnf"
    gbnf.write_text('root ::= " yes" | " no" | undefined')
    r = _cli("run", "-m", path, "-p", "x", "--grammar-file", str(gbnf))
    assert r.returncode != 0 and "g.gbnf" in r.stderr and "undefined" in r.stderr and "Traceback" not in r.stderr


def test_cli_takes_llama_cpp_flags(tmp_path):
    """llama-cli's -ngl, -ctk/-ctv, -fa, -f and -sys mean what they mean there; what stowlm cannot
    do (-fa off, K and V in two types, -ngl beside --devices) is refused, naming the flags."""
    path = str(get_model("smollm2-135m"))
    prompt = "The capital of France is"
    plain = _cli("run", path, "-p", prompt, "-n", "6", "--temp", "0", "-q")
    (tmp_path / "p.txt").write_text(prompt)
    r = _cli("run", "-m", path, "-f", str(tmp_path / "p.txt"), "-n", "6", "--temp", "0", "-q", "-fa", "-ngl", "0")
    assert r.returncode == 0 and r.stdout == plain.stdout, r.stderr
    q8 = _cli("run", path, "-p", prompt, "-n", "6", "--temp", "0", "-q", "--kv-type", "q8_0")
    r = _cli("run", path, "-p", prompt, "-n", "6", "--temp", "0", "-q", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on")
    assert r.returncode == 0 and r.stdout == q8.stdout, r.stderr
    found, _ = stowlm._core.cuda.devices()
    if not found:  # llama.cpp's CPU builds run on the CPU too; stowlm says so
        r = _cli("run", path, "-p", prompt, "-n", "6", "--temp", "0", "-q", "-ngl", "99")
        assert r.returncode == 0 and r.stdout == plain.stdout and "stowlm: warning: -ngl 99" in r.stderr, r.stderr
    for args, why in ((["-ctk", "q8_0", "-ctv", "f16"], "one type"), (["-fa", "off"], "-fa off"),
                      (["-ngl", "4", "--devices", "cpu"], "-ngl"), (["-f", str(tmp_path / "none.txt")], "none.txt"),
                      (["-ngl", "-3"], "-ngl")):
        r = _cli("run", path, "-p" if args[0] != "-f" else "-q", *(["x"] if args[0] != "-f" else []), *args)
        assert r.returncode != 0 and why in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
