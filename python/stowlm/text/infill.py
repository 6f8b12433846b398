"""Fill-in-the-middle prompts: the text before the cursor and the text after it, wrapped in the
model's FIM tokens (prefix, suffix, then middle: the model writes what goes between). The tokens
are found by the spellings the code models' vocabularies use (Qwen2.5-Coder and CodeGemma,
StarCoder, CodeLlama, DeepSeek-Coder)."""
from __future__ import annotations

from typing import List, Optional, Tuple

__all__ = ["fim_tokens", "fim_prompt"]

# (prefix, suffix, middle) as each family spells them
SPELLINGS = [("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
             ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
             ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),
             ("<PRE>", "<SUF>", "<MID>"),
             ("▁<PRE>", "▁<SUF>", "▁<MID>"),
             ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>")]


def fim_tokens(tokenizer) -> Optional[Tuple[int, int, int]]:
    """The model's (prefix, suffix, middle) token ids, or None when it has none."""
    for spelling in SPELLINGS:
        ids = [tokenizer.token_to_id(t) for t in spelling]
        if all(i is not None for i in ids):
            return ids[0], ids[1], ids[2]
    return None


def fim_prompt(tokenizer, prefix: str, suffix: str, name: str = "the model") -> List[int]:
    """[BOS where the model adds one] PRE prefix SUF suffix MID: the model continues with the middle."""
    ids = fim_tokens(tokenizer)
    if ids is None:
        raise ValueError(f"{name} has no fill-in-the-middle tokens (none of "
                         f"{', '.join(s[0] for s in SPELLINGS)} in its vocabulary)")
    pre, suf, mid = ids
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    return bos + [pre] + tokenizer.encode(prefix, add_special=False, parse_special=False) + [suf] + \
        tokenizer.encode(suffix, add_special=False, parse_special=False) + [mid]
