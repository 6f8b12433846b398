"""Fill-in-the-middle prompts: the text before the cursor and the text after it, wrapped in the
model's FIM tokens (prefix, suffix, then middle: the model writes what goes between). The tokens
are found by the spellings the code models' vocabularies use (Qwen2.5-Coder and CodeGemma,
StarCoder, CodeLlama, DeepSeek-Coder). infill_prompt adds what editor plugins send to
llama-server's /infill: other files as context before the prefix (in Qwen2.5-Coder's repository
format where the model has its repository and file separator tokens), and the whole cut to fit."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

__all__ = ["fim_tokens", "fim_prompt", "infill_prompt", "FIM_EOG_TEXTS"]

# (prefix, suffix, middle) as each family spells them
SPELLINGS = [("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
             ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
             ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),
             ("<PRE>", "<SUF>", "<MID>"),
             ("▁<PRE>", "▁<SUF>", "▁<MID>"),
             ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>")]
# repository-level context: the repository name token and the file separator (Qwen2.5-Coder's, StarCoder2's)
REPO_SPELLINGS = [("<|repo_name|>", "<|file_sep|>"), ("<reponame>", "<file_sep>")]
# tokens that end a generation where the model has them (llama.cpp's rule too): after the middle
# a code model starts the next file or pads
FIM_EOG_TEXTS = {"<|fim_pad|>", "<fim_pad>", "<fim-pad>", "<|repo_name|>", "<reponame>", "<|file_sep|>", "<file_sep>"}
# between extra files where the model has no file separator (the text llama-server puts there)
_SNIPPET = "\n\n--- snippet ---\n\n"


def _first_spelling(tokenizer, spellings) -> Optional[tuple]:
    """The ids of the first spelling whose every token the vocabulary has, or None."""
    for spelling in spellings:
        ids = [tokenizer.token_to_id(t) for t in spelling]
        if all(i is not None for i in ids):
            return tuple(ids)
    return None


def fim_tokens(tokenizer) -> Optional[Tuple[int, int, int]]:
    """The model's (prefix, suffix, middle) token ids, or None when it has none."""
    return _first_spelling(tokenizer, SPELLINGS)


def fim_prompt(tokenizer, prefix: str, suffix: str, name: str = "the model") -> List[int]:
    """[BOS where the model adds one] PRE prefix SUF suffix MID: the model continues with the middle."""
    return infill_prompt(tokenizer, prefix, suffix, name=name)


def infill_prompt(tokenizer, prefix: str, suffix: str, extra: Sequence[Tuple[str, str]] = (), prompt: str = "",
                  budget: Optional[int] = None, name: str = "the model") -> List[int]:
    """llama-server's /infill prompt: [BOS] [other files] PRE prefix+prompt SUF suffix MID.

    extra: (filename, text) pairs of other files, in order; with the model's repository tokens as
    <|repo_name|>project, then <|file_sep|>filename and its text a file, then <|file_sep|> naming the
    current file (Qwen2.5-Coder's repository format), else joined by snippet separators. prompt: text
    right before the cursor, after prefix. budget: the most tokens the prompt may have; past it the
    extra files go first (the earliest whole files), then the prefix loses its start and the suffix
    its end, 3:1 (the text nearest the cursor stays)."""
    ids = fim_tokens(tokenizer)
    if ids is None:
        raise ValueError(f"{name} has no fill-in-the-middle tokens (none of "
                         f"{', '.join(s[0] for s in SPELLINGS)} in its vocabulary)")
    pre, suf, mid = ids
    enc = lambda text: tokenizer.encode(text, add_special=False, parse_special=False)  # noqa: E731
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    head = enc(prefix + prompt)
    tail = enc(suffix)
    repo = _first_spelling(tokenizer, REPO_SPELLINGS)
    files = [([repo[1]] + enc(f"{fname}\n") if repo else enc(_SNIPPET)) + enc(text) for fname, text in extra]
    lead = [repo[0]] + enc("project\n") if repo and files else []
    current = [repo[1]] + enc("filename\n") if repo and files else []
    fixed = len(bos) + 3 + len(lead) + len(current)
    if budget is not None:
        room = budget - fixed - len(head) - len(tail)
        while files and room < sum(len(f) for f in files):
            files.pop(0)
        room = budget - fixed
        if not files:
            lead, current, room = [], [], budget - len(bos) - 3
        if len(head) + len(tail) > room:
            if room < 2:
                raise ValueError(f"an infill prompt needs more than the {budget} tokens it may have")
            keep_tail = min(len(tail), max(room // 4, room - len(head)))
            keep_head = min(len(head), room - keep_tail)
            head, tail = head[len(head) - keep_head:], tail[:keep_tail]
    return bos + lead + [t for f in files for t in f] + current + [pre] + head + [suf] + tail + [mid]
