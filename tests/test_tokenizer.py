"""Tokenizer against llama.cpp's recorded token ids (shared/fixtures), plus round trips, streaming
detokenization and the special-token rules."""
import numpy as np
import pytest

from _meta import read_metadata, read_metadata_gguf
from conftest import DENSE_MODELS, get_model, load_fixture
from stowlm.text.tokenizer import StreamingDetokenizer, Tokenizer, TokenType

_TOKS = {}


def tokenizer(name):
    if name not in _TOKS:
        _TOKS[name] = Tokenizer.from_metadata(read_metadata(str(get_model(name))), name)
    return _TOKS[name]


def fixture_texts(name):
    return sorted({r["text"] for r in load_fixture(name)})


@pytest.mark.parametrize("name", DENSE_MODELS)
def test_ids_match_llama_cpp(name):
    tok = tokenizer(name)
    records = load_fixture(name)
    assert sum(r["kind"] == "tok" for r in records) >= 20
    bad = []
    for r in records:
        # "tok" records: llama_tokenize(text, add_special, parse_special=true);
        # "logits" records: the prompt ids, tokenized with add_special=true
        got = tok.encode(r["text"], add_special=r["add_special"], parse_special=True)
        if got != r["ids"]:
            bad.append((r["kind"], r["add_special"], r["text"][:60], r["ids"][:16], got[:16]))
    assert not bad, f"{name}: {len(bad)} of {len(records)} records differ from llama.cpp: {bad[:3]}"


@pytest.mark.parametrize("name", DENSE_MODELS)
def test_round_trip(name):
    tok = tokenizer(name)
    for text in fixture_texts(name):
        ids = tok.encode(text, add_special=False)
        assert tok.decode(ids) == text, (name, text)
        ids = tok.encode(text, add_special=True)
        if tok.add_bos:
            assert ids[0] == tok.bos_id
            assert tok.decode(ids[1:]) == text
        has_control = any(tok.is_special(i) for i in tok.encode(text, add_special=False))
        if not has_control:
            assert tok.decode(ids, skip_special=True) == text, (name, text)


@pytest.mark.parametrize("name", DENSE_MODELS)
def test_streaming_detokenizer_matches_decode(name):
    tok = tokenizer(name)
    for text in fixture_texts(name):
        ids = tok.encode(text, add_special=True)
        det = tok.detokenizer(skip_special=False)
        pieces = [det.feed(i) for i in ids] + [det.flush()]
        assert "".join(pieces) == tok.decode(ids)
        assert all("\ufffd" not in p for p in pieces), (name, text, pieces)


def test_streaming_holds_back_partial_utf8_smollm():
    tok = tokenizer("smollm2-135m")
    text = "Emoji: 🤖🚀👍🏽 and flags 🇩🇪🇯🇵"
    ids = tok.encode(text)
    ref = next(r["ids"] for r in load_fixture("smollm2-135m") if r["kind"] == "tok" and r["text"] == text)
    assert ids == ref
    raw = [tok.token_bytes(i) for i in ids]
    assert b"".join(raw) == text.encode()

    def valid(b):
        try:
            b.decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False

    # the emoji really are cut across tokens, so a per-token decode would break them
    assert sum(not valid(b) for b in raw) >= 3
    det = StreamingDetokenizer(tok)
    pieces = [det.feed(i) for i in ids]
    assert det.flush() == ""
    assert "".join(pieces) == text
    assert all(valid(p.encode()) and "\ufffd" not in p for p in pieces)
    assert "" in pieces  # something was held back at least once
    # each emitted piece ends on a character boundary of the text: it is a prefix step
    acc = ""
    for p in pieces:
        acc += p
        assert text.startswith(acc)


def test_gemma_byte_fallback_and_streaming():
    tok = tokenizer("gemma3-270m")
    found = None
    for ch in ["\ue000", "\U000f0000", "\U00013000", "\u2fff", "\U0001fbf9", "\u0870", "\U0001e030"]:
        if tok.token_to_id(ch) is None:
            found = ch
            break
    assert found is not None
    text = "a" + found + "b"
    ids = tok.encode(text, add_special=False)
    want_bytes = [tok.token_to_id(f"<0x{b:02X}>") for b in found.encode()]
    assert all(i is not None for i in want_bytes)
    # SentencePiece byte fallback: a character outside the vocabulary becomes its UTF-8 bytes
    n = len(want_bytes)
    starts = [k for k in range(len(ids) - n + 1) if ids[k:k + n] == want_bytes]
    assert starts, (ids, want_bytes)
    assert all(tok.token_types[i] == TokenType.BYTE for i in want_bytes)
    assert tok.decode(ids) == text
    det = tok.detokenizer()
    pieces = [det.feed(i) for i in ids]
    assert "".join(pieces) + det.flush() == text
    assert all("\ufffd" not in p for p in pieces)


def test_incomplete_sequence_at_end_becomes_replacement_char():
    tok = tokenizer("gemma3-270m")
    first_byte = tok.token_to_id("<0xF0>")
    det = tok.detokenizer()
    assert det.feed(first_byte) == ""
    assert det.flush() == "\ufffd"
    assert tok.decode([first_byte]) == "\ufffd"


def test_parse_special_off_keeps_control_text_as_text():
    cases = {"smollm2-135m": "<|im_start|>user\nHi there<|im_end|>",
             "qwen2.5-coder-0.5b": "<|im_start|>user\nHi there<|im_end|>",
             "gemma3-270m": "<start_of_turn>user\nHi<end_of_turn>"}
    for name, text in cases.items():
        tok = tokenizer(name)
        with_special = tok.encode(text, add_special=False, parse_special=True)
        assert any(tok.is_special(i) for i in with_special)
        plain = tok.encode(text, add_special=False, parse_special=False)
        assert not any(tok.is_special(i) for i in plain), (name, plain)
        assert tok.decode(plain) == text


def test_parse_special_off_equals_vocabulary_without_specials():
    # parse_special=False must tokenize control-token text exactly as a vocabulary in which those
    # tokens are ordinary entries (where the BPE never merges up to them) would
    meta = dict(read_metadata(str(get_model("smollm2-135m"))))
    tok = tokenizer("smollm2-135m")
    plain_meta = dict(meta, **{"tokenizer.ggml.token_type": np.ones(tok.vocab_size, dtype=np.int32)})
    plain = Tokenizer.from_metadata(plain_meta, cache=False)
    # (<|im_end|> and <|endoftext|> stay control even there: llama.cpp forces end-of-turn tokens to
    # control by their text, so texts with them are left out)
    texts = [t for t in fixture_texts("smollm2-135m") if "<|im_end|>" not in t]
    texts += ["<|im_start|>system\n<file_sep>x<jupyter_code>y<empty_output>"]
    for text in texts:
        assert tok.encode(text, parse_special=False) == plain.encode(text, parse_special=True), text


def test_user_defined_tokens_always_split_gemma():
    # gemma's runs of newlines/spaces/tabs are user-defined: matched even without parse_special
    tok = tokenizer("gemma3-270m")
    nl3 = tok.token_to_id("\n\n\n")
    assert tok.token_types[nl3] == TokenType.USER_DEFINED
    for parse_special in (True, False):
        ids = tok.encode("a\n\n\nb", add_special=False, parse_special=parse_special)
        assert nl3 in ids


def test_special_ids_and_eog():
    s = tokenizer("smollm2-135m")
    assert (s.bos_id, s.eos_id, s.add_bos) == (1, 2, False)
    assert {0, 2} <= s.eog_ids and s.is_eog(2) and not s.is_eog(1)
    g = tokenizer("gemma3-270m")
    assert (g.bos_id, g.eos_id, g.add_bos, g.add_space_prefix) == (2, 1, True, False)
    assert {1, g.token_to_id("<end_of_turn>")} <= g.eog_ids
    q = tokenizer("qwen2.5-coder-0.5b")
    assert q.eos_id == 151645 and {151643, 151645} <= q.eog_ids
    assert q.decode([151644]) == "<|im_start|>" and q.decode([151644], skip_special=True) == ""


def test_lists_and_numpy_arrays_give_same_tokenizer():
    meta = read_metadata(str(get_model("smollm2-135m")))
    as_lists = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in meta.items()}
    a = Tokenizer.from_metadata(meta, cache=False)
    b = Tokenizer.from_metadata(as_lists, cache=False)
    for text in fixture_texts("smollm2-135m"):
        assert a.encode(text) == b.encode(text)


def test_metadata_reader_agrees_with_gguf_package(tmp_path):
    # a small file with every metadata value type, written by the gguf package's writer
    import gguf

    path = tmp_path / "kv.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "ab", "\u2581x", "日本", "<0x0A>"])
    w.add_array("tokenizer.ggml.merges", ["a b"])
    w.add_array("tokenizer.ggml.scores", [0.0, -1.5, -2.0, 3.25, 1e-3, -1000.0])
    w.add_array("tokenizer.ggml.token_type", [1, 1, 1, 4, 3, 6])
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_uint32("tokenizer.ggml.bos_token_id", 2)
    w.add_int32("general.i32", -7)
    w.add_uint64("general.u64", 1 << 40)
    w.add_int64("general.i64", -(1 << 40))
    w.add_float32("general.f32", 0.5)
    w.add_float64("general.f64", -0.25)
    w.add_uint8("general.u8", 200)
    w.add_int8("general.i8", -100)
    w.add_uint16("general.u16", 60000)
    w.add_int16("general.i16", -30000)
    w.add_tensor("t", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, ref = read_metadata(str(path)), read_metadata_gguf(str(path))
    assert set(ours) == set(ref) and "general.i16" in ours
    for k, v in ours.items():
        if isinstance(v, np.ndarray):
            np.testing.assert_array_equal(v, np.asarray(ref[k]), err_msg=k)
        else:
            assert v == ref[k], k


def test_bad_input():
    tok = tokenizer("smollm2-135m")
    with pytest.raises(TypeError):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
    meta = dict(read_metadata(str(get_model("smollm2-135m"))))
    with pytest.raises(ValueError, match="tokenizer.ggml.pre"):
        Tokenizer.from_metadata(dict(meta, **{"tokenizer.ggml.pre": "no-such-pre"}), "m", cache=False)
    with pytest.raises(ValueError, match="tokenizer.ggml.model"):
        Tokenizer.from_metadata(dict(meta, **{"tokenizer.ggml.model": "rwkv"}), "m", cache=False)
    del meta["tokenizer.ggml.tokens"]
    with pytest.raises(ValueError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_metadata(meta, "m")


# ---------------------------------------------------------------------------------------------
# A direct transcription of llama.cpp's SentencePiece procedure (special-token partition longest
# first, then: merge the adjacent pair whose result has the best score, leftmost on ties; pieces
# not in the vocabulary fall back to bytes), as an oracle for texts the fixtures do not cover.

def _spm_reference(tok, text, parse_special=True):
    import heapq

    types = tok.token_types
    mask = types == TokenType.USER_DEFINED
    if parse_special:
        mask |= (types == TokenType.CONTROL) | (types == TokenType.UNKNOWN)
    specials = sorted(np.nonzero(mask)[0].tolist(), key=lambda i: -len(tok.id_to_token(i)))
    frags = [text]
    for sid in specials:
        s = tok.id_to_token(sid)
        out = []
        for f in frags:
            if isinstance(f, int) or s not in f:
                out.append(f)
                continue
            parts = f.split(s)
            for k, p in enumerate(parts):
                if k:
                    out.append(sid)
                if p:
                    out.append(p)
        frags = out
    scores = tok._ref_scores
    ids = []
    for f in frags:
        if isinstance(f, int):
            ids.append(f)
            continue
        sym = list(f.replace(" ", "\u2581"))
        alive = [True] * len(sym)
        nxt = list(range(1, len(sym))) + [-1]
        prv = list(range(-1, len(sym) - 1))
        heap = []

        def push(a, b):
            if a < 0 or b < 0:
                return
            t = tok.token_to_id(sym[a] + sym[b])
            if t is not None:
                heapq.heappush(heap, (-scores[t], a, b, len(sym[a]) + len(sym[b])))

        for k in range(len(sym) - 1):
            push(k, k + 1)
        while heap:
            _, a, b, size = heapq.heappop(heap)
            if not alive[a] or not alive[b] or nxt[a] != b or len(sym[a]) + len(sym[b]) != size:
                continue
            sym[a] += sym[b]
            alive[b] = False
            nxt[a] = nxt[b]
            if nxt[b] >= 0:
                prv[nxt[b]] = a
            push(prv[a], a)
            push(a, nxt[a])
        for k, s in enumerate(sym):
            if not alive[k]:
                continue
            t = tok.token_to_id(s)
            if t is not None:
                ids.append(t)
            else:
                ids.extend(tok.token_to_id(f"<0x{b:02X}>") for b in s.encode())
    return ids


def test_gemma_matches_spm_reference_on_random_text():
    tok = tokenizer("gemma3-270m")
    meta = read_metadata(str(get_model("gemma3-270m")))
    tok._ref_scores = np.asarray(meta["tokenizer.ggml.scores"], dtype=np.float64)
    rng = np.random.default_rng(1234)
    alphabet = (list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
                + list(" .,;:!?'\"()[]{}<>/\\|-_=+*&^%$#@~`") + ["  ", "   ", "\n", "\n\n", "\t", "\r\n"]
                + list("éèüöäßçñøåœæ—–…«»“”‘’€£¥") + list("日本語中文한국어テキスト") + list("мирпривет")
                + ["🤖", "🚀", "👍🏽", "🇩🇪", "\ue000", "\U000f0000", "\u200b", "\u00a0"]
                + ["<start_of_turn>", "<end_of_turn>", "<bos>", "<unused7>", "ing", "tion", " the", "▁"])
    words = ["hello", "world", "the", "quick", "tokenization", "aaaa", "xxxxxxxx", "ababab", "1234567"]
    for _ in range(150):
        n = int(rng.integers(1, 25))
        parts = [alphabet[int(rng.integers(len(alphabet)))] if rng.random() < 0.7
                 else words[int(rng.integers(len(words)))] for _ in range(n)]
        text = "".join(parts)
        for parse_special in (True, False):
            want = _spm_reference(tok, text, parse_special)
            got = tok.encode(text, add_special=False, parse_special=parse_special)
            assert got == want, (text, parse_special, got, want)


# ---------------------------------------------------------------------------------------------
# Small hand-made vocabularies: the llama3 pre-tokenizer's ignore_merges, SentencePiece's
# add_space_prefix, invalid UTF-8 tokens; paths the three real models do not take.

def _byte_level_meta(pre):
    from stowlm.text.tokenizer import _bytes_to_unicode

    chars = list(_bytes_to_unicode().values())
    extra = ["ab", "abc", "Ġa", "Ġab", "\udcff\udcfe", "<s>", "<|eot_id|>"]
    tokens = chars + extra
    types = np.ones(len(tokens), dtype=np.int32)
    types[-2:] = TokenType.CONTROL
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": len(tokens) - 2,
            "tokenizer.ggml.merges": ["a b", "Ġ a", "Ġa b", "x yz"]}


def test_llama3_ignore_merges_and_default_bos():
    meta = _byte_level_meta("llama3")
    tok = Tokenizer.from_metadata(meta, "tiny-llama3", cache=False)
    ids = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    bos = ids["<s>"]
    # "abc" is a whole pre-token found in the vocabulary: used as is, although no merge makes it
    assert tok.encode("abc") == [bos, ids["abc"]]
    assert tok.encode(" ab", add_special=False) == [ids["Ġab"]]
    assert tok.is_eog(ids["<|eot_id|>"]) and tok.eot_id == ids["<|eot_id|>"]
    g = Tokenizer.from_metadata(_byte_level_meta("gpt2"), "tiny-gpt2", cache=False)
    assert g.encode("abc") == [ids["ab"], ids["c"]]  # plain BPE: only the merges
    assert not g.add_bos
    # the invalid-UTF-8 token decodes to its raw bytes
    assert g.decode_bytes([ids["\udcff\udcfe"]]) == b"\xff\xfe"
    assert g.decode([ids["a"], ids["\udcff\udcfe"]]) == "a\ufffd\ufffd"


def _spm_meta(add_space_prefix):
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + \
        ["▁", "a", "b", "c", "ab", "▁a", "▁b", "bc", "abc"]
    types = np.array([2, 3, 3] + [6] * 256 + [1] * 9, dtype=np.int32)
    scores = np.array([0, 0, 0] + [0] * 256 + [-1, -2, -3, -4, -5, -6, -7, -8, -9], dtype=np.float32)
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    if add_space_prefix is not None:
        meta["tokenizer.ggml.add_space_prefix"] = add_space_prefix
    return meta


def test_spm_space_prefix_scores_and_bytes():
    meta = _spm_meta(None)  # SentencePiece default: add a space prefix, add BOS
    ids = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    tok = Tokenizer.from_metadata(meta, "tiny-spm", cache=False)
    assert tok.add_space_prefix and tok.add_bos
    # best score first: "ab" (-5) before "bc" (-8), then ab + c -> "abc" (-9); "▁ab" is no token
    assert tok.encode("abc", add_special=False) == [ids["▁"], ids["abc"]]
    assert tok.encode("a b", add_special=False) == [ids["▁a"], ids["▁b"]]
    # a prefix space after each special token, as llama.cpp does (is_prev_special)
    assert tok.encode("a</s>b", add_special=True) == [1, ids["▁a"], 2, ids["▁b"]]
    # unknown character -> UTF-8 bytes
    assert tok.encode("é", add_special=False) == [ids["▁"], ids["<0xC3>"], ids["<0xA9>"]]
    # decoding takes the prefix space off again
    assert tok.decode(tok.encode("a b", add_special=False)) == "a b"
    assert tok.decode(tok.encode("abc é")) == "<s>abc é"
    assert tok.decode(tok.encode("abc é"), skip_special=True) == "abc é"
    det = tok.detokenizer()
    assert "".join(det.feed(i) for i in tok.encode("a bé")) + det.flush() == "a bé"
    off = Tokenizer.from_metadata(_spm_meta(False), "tiny-spm2", cache=False)
    assert off.encode("a b", add_special=False) == [ids["a"], ids["▁b"]]


def test_native_gguf_metadata_builds_the_same_tokenizer():
    from stowlm.gguffile import GGUFFile

    with GGUFFile(get_model("smollm2-135m")) as f:
        tok = Tokenizer.from_metadata(f.metadata, "smollm2-135m", cache=False)
    for r in load_fixture("smollm2-135m"):
        assert tok.encode(r["text"], add_special=r["add_special"]) == r["ids"]
