"""Lookahead decoding on the real embedded target (SmolLM2-135M-Instruct): greedy output equals
plain decoding on 3 dev prompts x 32 tokens, one at a time and as a batch of 3."""

import json
from pathlib import Path

import pytest

from specdec.decode import plain_generate, speculative_generate
from specdec.models import format_prompt, load_model
from specdec.proposers.lookahead import LookaheadProposer
from specdec.types import StopConditions
from tests.conftest import assert_greedy_equal

pytestmark = pytest.mark.real_model
SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "dev_prompts.jsonl"
MAX_NEW = 32


@pytest.fixture(scope="module")
def real():
    return load_model()


@pytest.fixture(scope="module")
def prompts(real):
    rows = [json.loads(line) for line in SHARED.read_text().splitlines()]
    picked = [next(r for r in rows if r["category"] == c) for c in ("code", "summarization", "chat")]
    return [format_prompt(real.tokenizer, r["turns"][0])[-200:] for r in picked]


@pytest.fixture(scope="module")
def plain(real, prompts):
    stop = StopConditions(max_new_tokens=MAX_NEW, eos_token_ids=real.lm.eos_token_ids)
    return plain_generate(real.lm, prompts, stop=stop)


@pytest.mark.parametrize("batch", [1, 3])
def test_real_target_lookahead_equals_plain(real, prompts, plain, batch):
    stop = StopConditions(max_new_tokens=MAX_NEW, eos_token_ids=real.lm.eos_token_ids)
    proposer = LookaheadProposer()  # the defaults
    if batch == 1:
        got = [speculative_generate(real.lm, proposer, [p], stop=stop, k=4)[0] for p in prompts]
    else:
        got = speculative_generate(real.lm, proposer, prompts, stop=stop, k=4)
    for p, g, w in zip(prompts, got, plain):
        assert_greedy_equal(real.lm, p, g.token_ids, w.token_ids)
    assert sum(g.stats.accepted for g in got) > 0, "no guess was accepted: the tree paths were not exercised"


def test_real_target_window_ngrams_get_accepted(real, prompts, plain):
    """Without context pooling every accepted guess is a Jacobi-window n-gram."""
    stop = StopConditions(max_new_tokens=MAX_NEW, eos_token_ids=real.lm.eos_token_ids)
    got = speculative_generate(real.lm, LookaheadProposer(pool_from_context=False), prompts, stop=stop, k=4)
    for p, g, w in zip(prompts, got, plain):
        assert_greedy_equal(real.lm, p, g.token_ids, w.token_ids)
    assert sum(g.stats.accepted for g in got) > 0
