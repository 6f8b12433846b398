"""`stowlm serve` over HTTP with the official openai client.

The server runs as a subprocess on 127.0.0.1 (a free port). Oracles: the same model in-process
(an LLM with the server's slots and context gives bit-identical greedy text), the server's own
answers one at a time against concurrent ones, the tokenizer's counts, and log-probabilities from
the in-process logits."""
import concurrent.futures as cf
import json
import random
import re
import time

import numpy as np
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import stowlm  # noqa: E402

from conftest import get_model, start_server, stop_server  # noqa: E402

KEY = "test-key-123"
PARALLEL, N_CTX = 4, 4 * 512


def _start(*args):
    return start_server(get_model("smollm2-135m"), *args)


def _stop(proc):
    return stop_server(proc)


@pytest.fixture(scope="module")
def server():
    proc, port = _start("--parallel", str(PARALLEL), "-c", str(N_CTX), "--api-key", KEY)
    yield port
    rc = _stop(proc)
    time.sleep(0.2)
    err = "".join(getattr(proc, "rest_of_stderr", []))
    assert rc == 0 and "Traceback" not in err, err  # Ctrl-C stops it cleanly


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local():
    """The same model in-process with the server's slots and context: the same numbers."""
    with stowlm.LLM(str(get_model("smollm2-135m")), n_ctx=N_CTX, n_seq=PARALLEL, progress=False) as llm:
        yield llm


MODEL = "smollm2-135m"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three fruits."}]


def test_models_and_health(client, server):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]
    r = httpx.get(f"http://127.0.0.1:{server}/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_chat_matches_the_in_process_model_streamed_and_not(client, local):
    want = local.chat(CHAT, max_tokens=24, temperature=0)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == want.text
    assert c.finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(local.chat_tokens(CHAT)) == want.prompt_tokens
    assert r.usage.completion_tokens == want.completion_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # streamed: the deltas add up to the same text, the last chunk says why, then usage
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == want.text
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [want.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want.completion_tokens


def test_completions_match_streamed_and_not(client, local):
    prompt = "The capital of France is"
    want = local.generate(prompt, max_tokens=12, temperature=0)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(local.tokenize(prompt)), 12)
    s = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in s) == want.text
    # token ids as the prompt, and several prompts at once
    ids = local.tokenize(prompt)
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert r2.choices[0].text == want.text
    r3 = client.completions.create(model=MODEL, prompt=[prompt, "Once upon a time"], max_tokens=6, temperature=0)
    assert [c.index for c in r3.choices] == [0, 1] and r3.choices[0].text == want.text[:len(r3.choices[0].text)]
    # echo: each choice's prompt before its text, whole and streamed, several prompts and choices
    other = local.generate("Once upon a time", max_tokens=6, temperature=0).text
    e = client.completions.create(model=MODEL, prompt=[prompt, "Once upon a time"], max_tokens=6, temperature=0,
                                  echo=True, n=2)
    assert [c.text for c in e.choices] == [prompt + want.text[:len(e.choices[0].text) - len(prompt)]] * 2 + \
        ["Once upon a time" + other] * 2
    s = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True, echo=True)
    assert "".join(ch.choices[0].text for ch in s if ch.choices) == prompt + want.text


def test_stop_strings_end_the_text(client, local):
    prompt = "Count: 1, 2, 3, 4,"
    full = local.generate(prompt, max_tokens=16, temperature=0).text
    assert " 6" in full
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[" 6", "zzz"])
    assert r.choices[0].text == full[:full.index(" 6")] and r.choices[0].finish_reason == "stop"
    s = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=" 6", stream=True)
    assert "".join(ch.choices[0].text for ch in s) == full[:full.index(" 6")]


def test_logprobs_are_the_model_log_softmax(client, local):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    ids = local.tokenize(prompt)
    ctx = stowlm.Context(local.model, n_ctx=512)
    x = ctx.eval(ids).astype(np.float64)
    ref = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
    best = int(ref.argmax())
    assert lp.tokens[0] == local.detokenize([best])
    assert abs(lp.token_logprobs[0] - ref[best]) < 0.02
    assert len(lp.top_logprobs[0]) == 3 and max(lp.top_logprobs[0].values()) == lp.token_logprobs[0]
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    c = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens - (c.choices[0].finish_reason == "stop")
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob <= 0
        assert bytes(e.bytes).decode("utf-8") == e.token
    assert "".join(e.token for e in content) == c.choices[0].message.content


def test_llama_servers_own_completion_and_props(client, server, local):
    """llama-server's POST /completion (its fields and shapes) and GET /props, for the clients
    written against it: the same text as the in-process model, its stop types, streamed as its
    events, and a repeated prompt's cached tokens (also in OpenAI's usage)."""
    base, h = f"http://127.0.0.1:{server}", {"Authorization": f"Bearer {KEY}"}
    prompt = "The capital of France is"
    want = local.generate(prompt, max_tokens=10, temperature=0)
    with httpx.Client(timeout=120, headers=h) as c:
        r = c.post(base + "/completion", json={"prompt": prompt, "n_predict": 10, "temperature": 0,
                                               "return_tokens": True, "n_probs": 2}).json()
        assert r["content"] == want.text and r["tokens"] == want.tokens and r["stop"] is True
        n_prompt = len(local.tokenize(prompt))
        assert (r["stop_type"], r["tokens_predicted"], r["tokens_evaluated"]) == ("limit", 10, n_prompt)
        ids = local.tokenize(prompt)
        x = stowlm.Context(local.model, n_ctx=512).eval(ids).astype(np.float64)
        ref = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
        p0 = r["completion_probabilities"][0]
        assert p0["id"] == want.tokens[0] == int(ref.argmax()) and abs(p0["logprob"] - ref.max()) < 0.02
        assert [t["id"] for t in p0["top_logprobs"]][:1] == [p0["id"]] and len(p0["top_logprobs"]) == 2
        assert r["timings"]["predicted_n"] == 10 and r["generation_settings"]["n_predict"] == 10
        # a stop word, named; the same prompt again takes its tokens from the slot's cache
        stop = want.text.split()[1] if len(want.text.split()) > 1 else want.text[-2:]
        w = c.post(base + "/completion", json={"prompt": prompt, "n_predict": 10, "temperature": 0,
                                               "stop": [stop]}).json()
        assert w["stop_type"] == "word" and w["stopping_word"] == stop and w["content"] == want.text.split(stop)[0]
        assert 0 < w["tokens_cached"] < len(ids) + 1
        events = [json.loads(line[6:]) for line in c.post(base + "/completion", json={
            "prompt": prompt, "n_predict": 10, "temperature": 0, "stream": True}).text.split("\n\n") if line]
        assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
        assert "".join(e["content"] for e in events) == want.text and events[-1]["stop_type"] == "limit"
        props = c.get(base + "/props").json()
        assert props["total_slots"] == PARALLEL and props["default_generation_settings"]["n_ctx"] == N_CTX // PARALLEL
        assert "im_start" in props["chat_template"]
        for body, param in (({"prompt": "x", "n": 2}, "n"), ({"prompt": "x", "id_slot": 1}, "id_slot"),
                            ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": "x", "mirostat": 3}, "mirostat")):
            e = c.post(base + "/completion", json=body)
            assert e.status_code == 400 and e.json()["error"]["param"] == param, e.text
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert 0 < again.usage.prompt_tokens_details.cached_tokens <= len(ids)
    # a client that leaves an unbounded request (n_predict -1) frees its slot
    with pytest.raises(httpx.TimeoutException):
        httpx.post(base + "/completion", json={"prompt": "Once upon a time", "ignore_eos": True}, headers=h, timeout=1.0)
    deadline = time.time() + 5  # well before its 2048 cells would fill
    while httpx.get(base + "/health").json()["slots_processing"] and time.time() < deadline:
        time.sleep(0.2)
    assert httpx.get(base + "/health").json()["slots_processing"] == 0


def test_seed_penalties_and_bias_are_applied(client, local):
    kw = dict(model=MODEL, prompt="My favourite animal is", max_tokens=12, temperature=1.0, seed=7)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text  # same seed, same text
    greedy = local.generate("My favourite animal is", max_tokens=1, temperature=0)
    ban = {str(greedy.tokens[0]): -100}
    r = client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=1, temperature=0,
                                  logit_bias=ban)
    assert r.choices[0].text != greedy.text
    pen = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3, 4,", max_tokens=16, temperature=0,
                                    frequency_penalty=2.0, presence_penalty=2.0)
    want = local.generate("Count: 1, 2, 3, 4,", max_tokens=16, temperature=0, frequency_penalty=2.0,
                          presence_penalty=2.0)
    assert pen.choices[0].text == want.text


def test_concurrent_requests_give_the_same_greedy_text(client):
    prompts = ["The capital of France is", "Once upon a time", "def fib(n):", "The three primary colors are",
               "In 1492,", "Water boils at", "My name is", "The best way to learn"]

    def ask(p):
        return client.completions.create(model=MODEL, prompt=p, max_tokens=20, temperature=0).choices[0].text

    alone = [ask(p) for p in prompts]
    with cf.ThreadPoolExecutor(8) as ex:
        together = list(ex.map(ask, prompts + prompts[::-1]))
    assert together == alone + alone[::-1]


def test_errors_have_openai_shapes(client, server):
    bad_key = openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    r = httpx.post(f"http://127.0.0.1:{server}/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-5", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hello " * 2100, max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded" and "2048" in e.value.message and "2101" in e.value.message
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello " * 2100}], max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "messages"
    # past one slot's 512 cells, within n_ctx: the request takes the cells of idle slots
    long = client.completions.create(model=MODEL, prompt="hello " * 700, max_tokens=3, temperature=0)
    assert long.usage.prompt_tokens == 701 and long.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", temperature="hot")
    assert e.value.body["param"] == "temperature"
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"http://127.0.0.1:{server}/v1/chat/completions", content=b"{not json", headers=h)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(f"http://127.0.0.1:{server}/v1/nothing", headers=h)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(f"http://127.0.0.1:{server}/v1/chat/completions", headers=h)
    assert r.status_code == 405


def _malformed(rng: random.Random) -> bytes:
    good = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    junk = [None, True, -1, 0, 2 ** 70, 1e308, -3.5, "x", "", [], [None], {}, {"a": 1}, [1, "a"], [[1, 2], "b"],
            [-5], [10 ** 9], "\u0000", {"role": "user"}]
    fields = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop", "seed",
              "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "stream",
              "stream_options", "model", "echo"]
    kind = rng.randrange(6)
    if kind == 0:  # not JSON at all
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    if kind == 1:  # JSON, not an object
        return json.dumps(rng.choice([[1, 2], "text", 3, None, True])).encode()
    if kind == 2:  # truncated JSON
        s = json.dumps(good)
        return s[:rng.randrange(1, len(s) - 1)].encode()
    body = dict(good)
    for _ in range(rng.randrange(1, 4)):
        body[rng.choice(fields)] = rng.choice(junk)
    if kind == 3:
        body["max_tokens"] = rng.choice(["10", 0, -4, 2.5, [1], True])
    if kind == 4:
        body["messages"] = rng.choice([[], "hi", [{"role": "wizard", "content": "x"}], [{"content": "x"}],
                                       [{"role": "user", "content": [{"type": "image_url"}]}], [1]])
        body["prompt"] = rng.choice([[], [-1], "", [[], []], 5])
    if kind == 5:
        body["logit_bias"] = rng.choice([{"abc": 1}, {"1": 500}, {"99999999": 1}, [1], {"1": "x"}])
    return json.dumps(body).encode()


def test_malformed_bodies_get_4xx_and_the_server_keeps_serving(client, server):
    rng = random.Random(1234)
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    statuses = []
    with httpx.Client(timeout=60) as c:
        for i in range(200):
            path = "/v1/chat/completions" if i % 2 else "/v1/completions"
            body = _malformed(rng)
            r = c.post(f"http://127.0.0.1:{server}{path}", content=body, headers=h)
            if r.status_code == 200:  # junk that happened to be valid: it must really have answered
                assert "choices" in r.json(), body
                continue
            statuses.append(r.status_code)
            assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
            assert isinstance(r.json()["error"]["message"], str)
    assert len(statuses) >= 150
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0).usage.completion_tokens == 2


def _metric(server, name):
    text = httpx.get(f"http://127.0.0.1:{server}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    m = re.search(rf"^stowlm_{name} (\S+)$", text, re.M)
    return float(m.group(1))


def test_metrics_and_a_disconnect_frees_the_slot(client, server):
    before = _metric(server, "completion_tokens_total")
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert _metric(server, "completion_tokens_total") == before + 3
    assert _metric(server, "slots") == PARALLEL and _metric(server, "queue_length") == 0
    # a stream left after two chunks: its slot is free again at once
    h = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"http://127.0.0.1:{server}/v1/completions", headers=h,
                      json={"prompt": "Once upon a time", "max_tokens": 400, "stream": True, "temperature": 0}) as r:
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    got += 1
                    if got == 2:
                        assert _metric(server, "slots_busy") == 1
                        break
    deadline = time.time() + 10
    while _metric(server, "slots_busy") != 0 and time.time() < deadline:
        time.sleep(0.1)
    assert _metric(server, "slots_busy") == 0
    assert _metric(server, "completion_tokens_total") < before + 3 + 400


def test_a_full_queue_answers_503():
    proc, port = _start("--parallel", "1", "--max-queue", "0", "-c", "512")
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        s = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=300, temperature=0, stream=True)
        next(iter(s))  # the only slot is busy
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
        assert e.value.status_code == 503 and e.value.body["code"] == "server_busy"
        s.close()
        deadline = time.time() + 10
        while True:  # once the stream is gone the server answers again
            try:
                assert c.completions.create(model=MODEL, prompt="Hi", max_tokens=1).usage.completion_tokens == 1
                break
            except openai.APIStatusError:
                assert time.time() < deadline
                time.sleep(0.1)
    finally:
        assert _stop(proc) == 0


def test_a_streamed_piece_is_the_event_json_dumps_makes():
    """The stream's per-token event is assembled from pieces made once; it must be the bytes of
    the general event (OpenAI's chunk shape) for any text: quotes, escapes, non-ASCII, newlines."""
    from stowlm.serve.events import PieceJson as _PieceJson, chunk_json as _chunk_json
    for chat in (True, False):
        for usage in (True, False):
            head = {"id": 'chatcmpl-"7', "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": 1700000000, "model": "mé/\\x"}
            piece = _PieceJson(head, chat, usage)
            for text in ["a", ' "quoted" \\ back', "é中\n\t", "\u2028", " "]:
                body = {"delta": {"content": text}} if chat else {"text": text}
                want = _chunk_json(head, [{"index": 2, **body, "logprobs": None, "finish_reason": None}], usage)
                assert piece(2, text) == want
                assert json.loads(want[6:])["choices"][0]["index"] == 2


def test_llama_servers_infill_for_editor_plugins():
    """llama-server's POST /infill, as llama.vim and llama.vscode call it: input_prefix, prompt (the
    current line before the cursor), input_suffix and input_extra (other files) become Qwen2.5-Coder's
    repository-format FIM prompt; the text is the in-process model's from those tokens spelled out by
    their vocabulary text. A prompt longer than the slot loses the extra files, then the prefix's
    start and the suffix's end; a model without FIM tokens is a 400 naming the field."""
    coder_path = get_model("qwen2.5-coder-0.5b")
    proc, port = start_server(coder_path, "-c", "1024", "--parallel", "1")
    base = f"http://127.0.0.1:{port}"
    try:
        with stowlm.LLM(str(coder_path), n_ctx=1024, progress=False) as coder:
            tid = coder.tokenizer.token_to_id
            enc = lambda t: coder.tokenize(t, add_special=False)  # noqa: E731
            pre, line, suf = "def add(a, b):\n", "    ", "\n\nprint(add(1, 2))\n"
            extra = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}]
            ids = ([tid("<|repo_name|>")] + enc("project\n") + [tid("<|file_sep|>")] + enc("util.py\n") +
                   enc(extra[0]["text"]) + [tid("<|file_sep|>")] + enc("filename\n") + [tid("<|fim_prefix|>")] +
                   enc(pre + line) + [tid("<|fim_suffix|>")] + enc(suf) + [tid("<|fim_middle|>")])
            want = coder.generate(ids, max_tokens=12, temperature=0)
            body = {"input_prefix": pre, "prompt": line, "input_suffix": suf, "input_extra": extra,
                    "n_predict": 12, "temperature": 0, "return_tokens": True}
            r = httpx.post(base + "/infill", json=body, timeout=120).json()
            assert r["content"] == want.text and r["tokens"] == want.tokens and r["tokens_evaluated"] == len(ids)
            assert "return a + b" in r["content"]
            # the model's file separator ends a generation, as llama.cpp decides
            assert coder.tokenizer.is_eog(tid("<|file_sep|>")) and coder.tokenizer.is_eog(tid("<|fim_pad|>"))
            events = [json.loads(x[6:]) for x in httpx.post(base + "/infill", json=dict(body, stream=True),
                                                           timeout=120).text.split("\n\n") if x]
            assert "".join(e["content"] for e in events) == want.text and events[-1]["stop"] is True
            # past the slot (1024 - 100 predicted): extra files first, then the prefix's start
            long_pre = "".join(f"x{i} = {i}\n" for i in range(400)) + pre
            r = httpx.post(base + "/infill", json=dict(body, input_prefix=long_pre, n_predict=100), timeout=120).json()
            assert 900 < r["tokens_evaluated"] <= 1024 - 100
            assert "util.py" not in r["prompt"] and "x0 = 0" not in r["prompt"] and pre + line in r["prompt"]
            assert r["prompt"].endswith(suf + "<|fim_middle|>")
            for bad, param in (({"input_prefix": 3}, "input_prefix"), ({"input_extra": [{"text": 1}]}, "input_extra"),
                               ({"input_prefix": "x", "mirostat": 3}, "mirostat")):
                e = httpx.post(base + "/infill", json=bad, timeout=30)
                assert e.status_code == 400 and e.json()["error"]["param"] == param, e.text
    finally:
        assert stop_server(proc) == 0


def test_infill_without_fim_tokens_is_refused_naming_the_field(server):
    h = {"Authorization": f"Bearer {KEY}"}
    e = httpx.post(f"http://127.0.0.1:{server}/infill", json={"input_prefix": "a", "input_suffix": "b"}, headers=h,
                   timeout=30)
    assert e.status_code == 400 and e.json()["error"]["param"] == "input_prefix"
    assert "fill-in-the-middle" in e.json()["error"]["message"]
