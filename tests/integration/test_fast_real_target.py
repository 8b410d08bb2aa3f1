"""The fast backend on the real embedded target: same logits and same greedy outputs as the
transformers path (3 dev prompts x 32 tokens)."""

import pytest
import torch

from specdec.decode import plain_generate, speculative_generate
from specdec.backends.fast import FastLlamaLM
from specdec.backends.hf import CausalLM
from specdec.proposers import PromptLookupProposer
from specdec.types import StopConditions
from tests.conftest import assert_greedy_equal
from tests.integration.conftest import dev_prompts

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def models(real):
    loaded = real
    return loaded, CausalLM(loaded.lm.model, "hf"), FastLlamaLM(loaded.lm.model, "fast")


@pytest.fixture(scope="module")
def prompts(real):
    return dev_prompts(real.tokenizer, ("code", "math", "chat"))


def test_fast_logits_match_transformers_on_the_real_target(models, prompts):
    _, hf, fast = models
    ca, cb = hf.new_cache(1), fast.new_cache(1)
    a, b = hf.prefill(ca, [prompts[0]]), fast.prefill(cb, [prompts[0]])
    torch.testing.assert_close(b.logits, a.logits, atol=1e-3, rtol=0)
    for q in (1, 2, 5):
        ids = torch.tensor([prompts[1][:q]])
        torch.testing.assert_close(fast.forward(cb, ids).logits, hf.forward(ca, ids).logits, atol=1e-3, rtol=0)


def test_fast_plain_decoding_equals_transformers_plain_decoding(models, prompts):
    loaded, hf, fast = models
    stop = StopConditions(max_new_tokens=32, eos_token_ids=loaded.lm.eos_token_ids)
    for p in prompts:
        want = plain_generate(hf, [p], stop=stop)[0].token_ids
        got = plain_generate(fast, [p], stop=stop)[0].token_ids
        assert_greedy_equal(hf, p, got, want)


def test_speculative_on_the_fast_target_equals_transformers_plain_decoding(models, prompts):
    loaded, hf, fast = models
    stop = StopConditions(max_new_tokens=32, eos_token_ids=loaded.lm.eos_token_ids)
    want = plain_generate(hf, prompts, stop=stop)
    got = speculative_generate(fast, PromptLookupProposer(), prompts, stop=stop, k=4)
    for p, g, w in zip(prompts, got, want):
        assert_greedy_equal(hf, p, g.token_ids, w.token_ids)
