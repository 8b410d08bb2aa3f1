"""Medusa on the real embedded target with the heads shipped in the package: greedy equality
with plain decoding for a chain, a narrow, a wide and the automatic tree on 3 dev prompts."""

import pytest

from specdec.decode import plain_generate, speculative_generate
from specdec.errors import IncompatibleModels
from specdec.medusa_heads import load_heads, read_config, shipped_heads_dir
from specdec.models import DEFAULT_TARGET
from specdec.testing import tiny_llama
from specdec.proposers.medusa import MedusaProposer
from specdec.types import StopConditions
from tests.conftest import assert_greedy_equal

pytestmark = pytest.mark.real_model
TREES = {"chain": "chain", "narrow": [[0], [1], [0, 0], [0, 0, 0]],
         "wide": [[0], [1], [2], [3], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]], "auto": None}


@pytest.fixture(scope="module")
def heads(real):
    return load_heads(shipped_heads_dir(DEFAULT_TARGET), real.lm)


@pytest.fixture(scope="module")
def plain(real, prompts):
    stop = StopConditions(max_new_tokens=32, eos_token_ids=real.lm.eos_token_ids)
    return [r.token_ids for r in plain_generate(real.lm, prompts, stop=stop)]


def test_heads_ship_with_the_package_and_name_their_target():
    d = shipped_heads_dir(DEFAULT_TARGET)
    assert d is not None
    cfg = read_config(d)
    # per-rank accuracies for every head: what --tree auto sizes its tree from
    assert cfg.target_name == DEFAULT_TARGET and len(cfg.accuracy) == cfg.num_heads and all(cfg.accuracy)
    assert sum(f.stat().st_size for f in d.iterdir()) <= 10 * 2**20


@pytest.mark.parametrize("tree", list(TREES))
def test_real_target_medusa_equals_plain(real, heads, prompts, plain, tree):
    stop = StopConditions(max_new_tokens=32, eos_token_ids=real.lm.eos_token_ids)
    got = speculative_generate(real.lm, MedusaProposer(real.lm, heads, TREES[tree]), prompts, stop=stop, k=4)
    for p, g, w in zip(prompts, got, plain):
        assert_greedy_equal(real.lm, p, g.token_ids, w)
    assert sum(g.stats.accepted for g in got) > 0, "no head candidate was accepted"


def test_shipped_heads_are_refused_for_another_target():
    with pytest.raises(IncompatibleModels):
        load_heads(shipped_heads_dir(DEFAULT_TARGET), tiny_llama(seed=0))
