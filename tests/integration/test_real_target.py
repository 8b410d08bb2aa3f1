"""Greedy equality on the real embedded target (SmolLM2-135M-Instruct), 3 dev prompts x 32 tokens."""

import pytest

from specdec.decode import plain_generate, speculative_generate
from specdec.models import early_exit_copy, format_prompt
from specdec.proposers import DraftModelProposer, PromptLookupProposer
from specdec.types import StopConditions
from tests.conftest import assert_greedy_equal

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def plain(real, prompts):
    stop = StopConditions(max_new_tokens=32, eos_token_ids=real.lm.eos_token_ids)
    return [plain_generate(real.lm, [p], stop=stop)[0] for p in prompts]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", ["draft_model", "prompt_lookup"])
def test_real_target_speculative_equals_plain(real, prompts, plain, name, batch):
    stop = StopConditions(max_new_tokens=32, eos_token_ids=real.lm.eos_token_ids)
    proposer = DraftModelProposer(early_exit_copy(real.lm, 2)) if name == "draft_model" else PromptLookupProposer()
    if batch == 1:
        got = [speculative_generate(real.lm, proposer, [p], stop=stop, k=4)[0] for p in prompts]
    else:
        got = speculative_generate(real.lm, proposer, prompts, stop=stop, k=4)
    for p, g, w in zip(prompts, got, plain):
        assert_greedy_equal(real.lm, p, g.token_ids, w.token_ids)
    assert sum(g.stats.accepted for g in got) > 0, "nothing was accepted: rollback paths were not exercised"


def test_default_target_answers_a_chat_prompt(real):
    ids = format_prompt(real.tokenizer, "What is the capital of France?")
    out = plain_generate(real.lm, [ids], stop=StopConditions(max_new_tokens=24, eos_token_ids=real.lm.eos_token_ids))[0]
    assert "Paris" in real.tokenizer.decode(out.token_ids)


def test_shipped_draft_is_the_default_and_lossless(prompts):
    """`--method draft` with no options: the draft shipped for the embedded target, on the engine's
    default backend, with k auto and k = 4, reproduces plain decoding token for token."""
    from specdec.drafts import shipped_draft_path
    from specdec.engine import Engine
    from specdec.models import DEFAULT_TARGET

    assert shipped_draft_path(DEFAULT_TARGET) is not None
    engine = Engine()
    stop = StopConditions(max_new_tokens=32)
    want = engine.generate_ids(prompts, method="plain", stop=stop)
    for k in ("auto", 4):
        got = engine.generate_ids(prompts, method="draft", stop=stop, k=k)
        for p, g, w in zip(prompts, got, want):
            assert_greedy_equal(engine.target.lm, p, g.token_ids, w.token_ids)
        assert sum(g.stats.accepted for g in got) > 0
    assert engine.draft.path == str(shipped_draft_path(DEFAULT_TARGET))


def test_incremental_text_equals_the_real_tokenizers_whole_decoding(real, plain):
    """The coordinator streams text decoded a window at a time (IncrementalText): after every
    step it must equal the whole answer decoded, on real answers and on random token runs
    (characters split over tokens, special tokens, spaces), pushed a speculative step at a time."""
    import random

    from specdec.stopping import IncrementalText

    tok = real.tokenizer
    detokenize = lambda ids: tok.decode(list(ids), skip_special_tokens=True)  # noqa: E731 - the coordinator's
    rng = random.Random(0)
    runs = [list(p.token_ids) for p in plain]
    runs += [[rng.randrange(len(tok)) for _ in range(200)] for _ in range(20)]
    for ids in runs:
        text, i = IncrementalText(detokenize, ids[:3]), 3
        while i < len(ids):
            step = rng.randint(1, 5)
            assert text.push(ids[i : i + step]) == detokenize(ids[: i + step])
            i += step


@pytest.mark.parametrize("way", ["chain", "tree", "by-confidence-with-lookup"])
def test_shipped_eagle_draft_is_lossless_on_the_real_target(real, prompts, plain, way):
    """The EAGLE draft shipped for the embedded target, as a chain, as a dynamic tree (64 nodes,
    as on a GPU's flat verify cost), and as eagle-lookup with its depth chosen by confidence
    on a CPU-like verify cost, reproduces plain decoding token for token."""
    from specdec.eagle import load_eagle, shipped_eagle_path
    from specdec.models import DEFAULT_TARGET
    from specdec.proposers import EagleLookupProposer, EagleProposer
    from specdec.proposers.eagle import DepthChoice
    from tests.conftest import GPU_LIKE_COST

    draft = load_eagle(shipped_eagle_path(DEFAULT_TARGET), real.lm)
    proposer = {"chain": lambda: EagleProposer(draft),
                "tree": lambda: EagleProposer(draft, verify_cost=GPU_LIKE_COST, runs_trees=True),
                "by-confidence-with-lookup": lambda: EagleLookupProposer(
                    draft, depth=DepthChoice(c=0.15, v={1: 1.0, 2: 1.2, 3: 1.5, 5: 2.1}))}[way]()
    stop = StopConditions(max_new_tokens=32, eos_token_ids=real.lm.eos_token_ids)
    got = [speculative_generate(real.lm, proposer, [p], stop=stop, k=4)[0] for p in prompts]
    for p, g, w in zip(prompts, got, plain):
        assert_greedy_equal(real.lm, p, g.token_ids, w.token_ids)
    assert sum(g.stats.accepted for g in got) > 0, "nothing was accepted: rollback paths were not exercised"
