"""Speculative decoding: a pass over several tokens gives each the logits of a one-token step (the
ground speculation stands on), greedy text with drafts equal to the text without, and sampled text
with the target's distribution."""
import numpy as np
import pytest

import stowlm
from stowlm.engine import Context

from conftest import get_model


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
