"""How deep EAGLE's chains go: each step drafts while one more token could pay and sends the
target the prefix that maximizes expected tokens per time on its verify cost, by the draft's
confidence (calibrated against the target's verdicts). Lossless as every method: greedy output
is plain decoding's, sampling is distributed as the target's."""

import pytest
import torch

from specdec.costmodel import tokens_worth_verifying, worth_including
from specdec.decode import speculative_generate
from specdec.eagle import build_eagle, load_eagle
from specdec.engine import Engine, EngineConfig
from specdec.errors import InvalidRequest
from specdec.models import LoadedModel
from specdec.proposers import EagleProposer, ProposerEnv, load_proposer
from specdec.proposers.eagle import DepthChoice, ReachByConfidence
from specdec.proposers.eagle_lookup import EagleLookupProposer, LookupReach, RowTables, judged_by
from specdec.proposers.prompt_lookup import longest_match
from specdec.types import SamplingParams, StopConditions
from tests.conftest import GPU_LIKE_COST, FixedCosts, assert_greedy_equal
from tests.unit.test_eagle import PROMPTS, _answers, data_dir, trained_dir  # noqa: F401 (fixtures)
from tests.unit.test_sampling_e2e import (PROMPT, ROWS, _assert_fits, _histogram, _joint_probs,  # noqa: F401
                                          small_vocab_target)

CPU_LIKE = {1: 1.0, 2: 1.3, 3: 1.6, 4: 1.9, 5: 2.2, 9: 3.4}  # verifying a few tokens costs ~1.3-2 steps
STEEP = {1: 1.0, 2: 1.2, 3: 1.5, 4: 1.9, 5: 2.4}


class EagleCosts(FixedCosts):
    """A verify-cost curve and EAGLE's step cost c as given, not this host's."""

    def __init__(self, curve: dict[int, float], c: float):
        super().__init__(curve)
        self.c = c

    def figure(self, key, what, measure, timed=True):
        return self.c if key["figure"] == "eagle_cost" else super().figure(key, what, measure, timed)


def test_a_cpu_curve_verifies_the_likely_tokens_only_and_a_flat_one_the_whole_chain():
    reach = [0.9, 0.5, 0.2, 0.1]
    assert tokens_worth_verifying(reach, 0.1, CPU_LIKE) == 1  # 1.9 / 1.4 beats 2.4 / 1.8
    assert tokens_worth_verifying([0.1], 0.1, CPU_LIKE) == 0  # 1.1 / 1.4: a plain step is faster
    assert tokens_worth_verifying(reach, 0.0, {1: 1.0, 64: 1.0}) == 4  # verifying is free: every token
    assert tokens_worth_verifying(reach, 0.05, {1: 1.0, 64: 1.0}) == 3  # the last adds 0.1 for 0.05 of a step
    assert tokens_worth_verifying([], 0.1, CPU_LIKE) == 0


def test_a_token_joins_the_block_judged_from_the_chain_up_to_it():
    assert worth_including([0.9], 4, 0.1, CPU_LIKE)  # 1.9 / 1.4 > 1
    assert not worth_including([0.9, 0.5], 4, 0.1, CPU_LIKE)  # even with two more at 0.5: 1.9 / 1.4 is best
    assert not worth_including([0.1], 4, 0.1, CPU_LIKE)  # 1.1 / 1.4: a plain step is faster
    assert worth_including([0.9, 0.5, 0.2], 4, 0.0, GPU_LIKE_COST)  # verifying is free: every token
    assert not worth_including([0.9, 0.5, 0.2], 2, 0.0, GPU_LIKE_COST)  # beyond k
    # alone it would not pay; with more like it, it does
    assert worth_including([0.6], 4, 0.0, {1: 1.0, 2: 1.7, 3: 1.75, 5: 1.8})


def test_reach_starts_from_the_confidence_and_follows_the_verdicts():
    table, steady = ReachByConfidence(prior_weight=8.0, window=64.0), ReachByConfidence(window=1e9)
    assert table.reach(0.35) == pytest.approx(0.35)  # the middle of its bucket, 0.3-0.4
    assert table.reach(0.0) == pytest.approx(0.01) and table.reach(1.0) == pytest.approx(0.95)
    assert table.chain([0.95, 0.35, 0.6]) == pytest.approx([0.95, 0.35, 0.35])  # never above the token before
    for t in (table, steady):
        for _ in range(20):
            t.record([0.35, 0.35], accepted=0)  # this draft is overconfident there
        assert t.reach(0.35) < 0.1 and t.reach(0.55) == pytest.approx(0.55)
        for _ in range(100):  # now it is right there
            t.record([0.35], accepted=1)
    assert table.reach(0.35) > 0.75 and table.reach(0.35) > steady.reach(0.35) + 0.05  # past the window old counts fade


def test_row_tables_follow_the_rows_as_they_leave_and_start_again_for_new_sequences():
    tables = RowTables(list)
    a, b = tables.follow((0, 1))
    a.append("seen")
    assert tables.follow((0,)) == [["seen"]] and tables.follow((0,))[0] is a  # row 1 left, row 0 goes on
    assert tables.follow((0, 2)) == [[], []]  # a new set of sequences


def test_config_refuses_an_unknown_eagle_depth():
    with pytest.raises(InvalidRequest, match="eagle_depth"):
        EngineConfig(eagle_depth="deep")


@pytest.mark.parametrize("k", [2, 5])
def test_chains_by_confidence_equal_plain_and_verify_fewer_tokens_on_a_cpu_curve(tiny_target, trained_dir, k):
    draft = load_eagle(trained_dir, tiny_target)
    rows = _answers(tiny_target, 4, seed=1)  # prompts like its training data: accepted often enough to draft
    prompts = [r["prompt_ids"] for r in rows] + PROMPTS
    stop = StopConditions(max_new_tokens=24, eos_token_ids=(10_000,))
    full = speculative_generate(tiny_target, EagleProposer(draft), prompts, stop=stop, k=k)
    depth = DepthChoice(c=0.05, v=CPU_LIKE)
    got = speculative_generate(tiny_target, EagleProposer(draft, depth=depth), prompts, stop=stop, k=k)
    for p, g, f in zip(prompts, got, full):
        assert_greedy_equal(tiny_target, p, g.token_ids, f.token_ids)
    drafted, accepted = (sum(r.stats.drafted for r in got), sum(r.stats.accepted for r in got))
    full_drafted, full_accepted = (sum(r.stats.drafted for r in full), sum(r.stats.accepted for r in full))
    assert 0 < drafted < full_drafted and accepted > 0
    assert accepted / drafted > full_accepted / full_drafted  # it drops the tokens unlikely to be accepted
    assert sum(depth.reach._counts[b][1] for b in range(len(depth.reach._counts))) == drafted  # every verdict learnt


def test_chains_by_confidence_draft_k_tokens_where_verifying_is_free(tiny_target, trained_dir):
    draft = load_eagle(trained_dir, tiny_target)
    stop = StopConditions(max_new_tokens=16, eos_token_ids=(10_000,))
    got = speculative_generate(tiny_target, EagleProposer(draft, depth=DepthChoice(c=0.0, v=GPU_LIKE_COST)),
                               PROMPTS, stop=stop, k=3)
    full = speculative_generate(tiny_target, EagleProposer(draft), PROMPTS, stop=stop, k=3)
    assert [r.stats.drafted for r in got] == [r.stats.drafted for r in full]


def test_sampled_chains_by_confidence_are_distributed_as_the_target(small_vocab_target):
    """The stop reads the draft's own figures and earlier verdicts only: rejection sampling stays exact."""
    lm = small_vocab_target
    sampling = SamplingParams(temperature=1.0, seed=21)
    proposer = EagleProposer(build_eagle(lm, torch.arange(6)), depth=DepthChoice(c=0.0, v=STEEP))
    results = speculative_generate(lm, proposer, [PROMPT] * ROWS, sampling=sampling,
                                   stop=StopConditions(max_new_tokens=3), k=3)
    drafted = sum(r.stats.drafted for r in results)
    assert sum(r.stats.accepted for r in results) > 0, "the draft never got accepted: the test checks nothing"
    assert 0 < drafted < 3 * sum(r.stats.target_forwards - 1 for r in results), "no chain was cut short"
    _assert_fits(_histogram(results), _joint_probs(lm, sampling))


def test_the_engine_chooses_depth_by_confidence_unless_told_k(tiny_target, trained_dir):
    def proposer(depth: str):
        env = ProposerEnv(tiny_target, EngineConfig(eagle_dir=str(trained_dir), eagle_depth=depth),
                          costs=EagleCosts(CPU_LIKE, 0.05), load_draft=lambda: None, gives_features=True)
        return load_proposer("eagle", env)()

    auto = proposer("auto")
    assert auto.depth is not None and auto.depth.c == 0.05 and auto.depth.v == CPU_LIKE
    assert proposer("k").depth is None
    engine = Engine.from_models(LoadedModel(tiny_target, None, "tiny"), costs=EagleCosts(CPU_LIKE, 0.05),
                                config=EngineConfig(eagle_dir=str(trained_dir)))
    stop = StopConditions(max_new_tokens=16, eos_token_ids=(10_000,))
    [got] = engine.generate_ids([PROMPTS[0]], "eagle", stop=stop, k=4)
    [want] = engine.generate_ids([PROMPTS[0]], "plain", stop=stop)
    assert_greedy_equal(tiny_target, PROMPTS[0], got.token_ids, want.token_ids)


# --- EAGLE with prompt lookup beside it ---------------------------------------------------------

def test_lookup_reach_starts_from_its_prior_per_match_length_and_learns_per_depth():
    table = LookupReach(prior_weight=4.0)
    assert table.chain(3, 3) == pytest.approx([0.45, 0.45 ** 2, 0.45 ** 3])
    assert table.alpha(40) == pytest.approx(0.85) and table.alpha(5) == pytest.approx(0.55)  # a long match: a copy
    for _ in range(50):
        table.record(1, drafted=4, accepted=4)  # 1-token matches copied every time here
    assert table.alpha(1) > 0.9 and table.alpha(2) == pytest.approx(0.3)
    for _ in range(50):  # a copy whose first token is a coin flip, but which then goes on being copied
        table.record(3, drafted=4, accepted=0)
        table.record(3, drafted=4, accepted=4)
    assert table.alpha(3, 0) == pytest.approx(0.5, abs=0.02) and table.alpha(3, 1) > 0.9 and table.alpha(3, 3) > 0.9
    assert table.chain(3, 4)[-1] > 0.4  # geometric at the first token's rate would say 0.06


def test_judged_by_says_what_verifying_an_unsent_chain_would_have_found():
    assert judged_by((5, 6, 7), (5, 9)) == (2, 1)  # rejected at its second token
    assert judged_by((5, 6, 7), (8,)) == (1, 0)
    assert judged_by((5, 6), (5, 6, 7)) == (2, 2)  # all of it accepted
    assert judged_by((5, 6, 7), (5, 6)) == (2, 2)  # its third token: not known from two emitted
    assert judged_by((), (5,)) == (0, 0)


def test_a_request_s_table_starts_from_the_shared_one_and_teaches_it_too():
    shared = LookupReach(prior_weight=4.0)
    for _ in range(40):
        shared.record(3, drafted=1, accepted=0)  # lookup wrong after 3-token matches, in the mix
    mine = LookupReach(prior_weight=4.0, parent=shared)
    assert mine.alpha(3) == pytest.approx(shared.alpha(3)) and shared.alpha(3) < 0.1
    for _ in range(20):
        mine.record(3, drafted=4, accepted=4)  # this request copies
    assert mine.alpha(3) > 0.7 and mine.alpha(3, 2) > 0.8
    assert shared.alpha(3) > 0.3 and shared.judged() == 40 + 80  # the mix heard of it too
    assert LookupReach(parent=shared).alpha(3) == pytest.approx(shared.alpha(3))  # a new request starts from the mix


def test_the_match_length_is_how_far_back_the_context_agrees():
    toks = [1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5]
    assert longest_match(toks, 3) == (5, (9, 1, 2))  # the 3-gram 3 4 5 matches, and so do 1 2 before it
    assert longest_match([7, 1, 2, 8, 1, 2], 2) == (2, (8, 1))
    assert longest_match(toks, 3, max_length=4) == (4, (9, 1, 2))
    assert longest_match([1, 2, 3], 2) == (0, ())


def test_a_copying_prompt_sends_lookup_s_chain_and_stays_plain_decoding(tiny_target, trained_dir):
    """A prompt that repeats itself: the tokens after the repeated part are the prompt's own
    continuation, which lookup drafts and the target accepts; output equals plain decoding."""
    draft = load_eagle(trained_dir, tiny_target)
    stop = StopConditions(max_new_tokens=24, eos_token_ids=(10_000,))
    [plain] = speculative_generate(tiny_target, EagleProposer(draft), [PROMPTS[2]], stop=stop, k=1)
    cycle = PROMPTS[2] + list(plain.token_ids)  # the target's own answer follows the prompt: copy it
    prompt = cycle + PROMPTS[2]
    depth = DepthChoice(c=0.05, v=CPU_LIKE)
    hybrid = EagleLookupProposer(draft, depth=depth)
    [got] = speculative_generate(tiny_target, hybrid, [prompt], stop=stop, k=4)
    [eagle] = speculative_generate(tiny_target, EagleProposer(draft, depth=DepthChoice(c=0.05, v=CPU_LIKE)),
                                   [prompt], stop=stop, k=4)
    assert_greedy_equal(tiny_target, prompt, got.token_ids, eagle.token_ids)
    assert hybrid.lookup.judged() > 0, "lookup's chain was never sent"
    assert got.stats.target_forwards < eagle.stats.target_forwards  # the copy is cheaper than EAGLE's guesses


def test_a_request_that_copies_gets_lookup_s_chain_where_the_mix_says_lookup_is_wrong(tiny_target, trained_dir):
    """The shared table says lookup's chains are nearly never accepted, so it would send none;
    lookup's table learns from the steps where EAGLE's chain was sent (what it would have found),
    and the request that copies its prompt gets lookup's chains after a few steps."""
    draft = load_eagle(trained_dir, tiny_target)
    stop = StopConditions(max_new_tokens=40, eos_token_ids=(10_000,))
    [plain] = speculative_generate(tiny_target, EagleProposer(draft), [PROMPTS[2]], stop=stop, k=1)
    prompt = PROMPTS[2] + list(plain.token_ids) + PROMPTS[2]  # the answer follows the prompt: copy it
    shared = LookupReach()
    for match in (1, 2, 3, 4, 6, 9, 16, 64):
        for _ in range(200):
            shared.record(match, drafted=1, accepted=0)
    assert all(shared.alpha(m) < 0.05 for m in (1, 3, 64))
    hybrid = EagleLookupProposer(draft, depth=DepthChoice(c=0.05, v=CPU_LIKE), lookup=shared)
    [got] = speculative_generate(tiny_target, hybrid, [prompt], stop=stop, k=4)
    [eagle] = speculative_generate(tiny_target, EagleProposer(draft, depth=DepthChoice(c=0.05, v=CPU_LIKE)),
                                   [prompt], stop=stop, k=4)
    assert_greedy_equal(tiny_target, prompt, got.token_ids, eagle.token_ids)
    assert got.stats.target_forwards < eagle.stats.target_forwards  # lookup's chains were sent once learnt
    assert shared.alpha(64) < 0.5  # what the row learnt went to the mix too, but the mix still says no


def test_where_lookup_s_chain_is_sure_to_go_eagle_s_step_is_skipped_and_catches_up_later(tiny_target, trained_dir):
    """A prompt that copies itself: once lookup's chains promise more than EAGLE's last chain,
    EAGLE's steps are skipped (the target's features wait for its next step, which the draft
    would refuse if any were missing), the output stays plain decoding's, and the target runs no
    more forwards than with EAGLE drafting every step."""
    draft = load_eagle(trained_dir, tiny_target)
    stop = StopConditions(max_new_tokens=40, eos_token_ids=(10_000,))
    [plain] = speculative_generate(tiny_target, EagleProposer(draft), [PROMPTS[2]], stop=stop, k=1)
    prompt = PROMPTS[2] + list(plain.token_ids) + PROMPTS[2] + [7, 8, 9, 10, 11]  # a copy, then new text
    steps = []

    class Watched(EagleLookupProposer):
        def catch_up(self, ctx):
            steps.append(("eagle", self.skipped))
            return super().catch_up(ctx)

    hybrid = Watched(draft, depth=DepthChoice(c=0.05, v=CPU_LIKE))
    [got] = speculative_generate(tiny_target, hybrid, [prompt], stop=stop, k=4)
    [eagle] = speculative_generate(tiny_target, EagleProposer(draft, depth=DepthChoice(c=0.05, v=CPU_LIKE)),
                                   [prompt], stop=stop, k=4)
    assert_greedy_equal(tiny_target, prompt, got.token_ids, eagle.token_ids)
    assert hybrid.skipped > 0 and any(skipped > 0 for _, skipped in steps)  # EAGLE ran again after skips
    assert got.stats.target_forwards < eagle.stats.target_forwards


def test_where_trees_cost_about_a_chain_lookup_s_chain_joins_eagle_s_tree(tiny_target, trained_dir):
    """A GPU-like verify cost: EAGLE drafts a tree, and lookup's chain is grafted onto it as one
    more branch, so a copying prompt takes fewer target forwards than EAGLE's tree alone, with
    plain decoding's output."""
    draft = load_eagle(trained_dir, tiny_target)
    stop = StopConditions(max_new_tokens=24, eos_token_ids=(10_000,))
    [plain] = speculative_generate(tiny_target, EagleProposer(draft), [PROMPTS[2]], stop=stop, k=1)
    prompt = PROMPTS[2] + list(plain.token_ids) + PROMPTS[2]

    def run(cls):
        proposer = cls(draft, verify_cost=GPU_LIKE_COST, runs_trees=True, depth=DepthChoice(c=0.05, v=GPU_LIKE_COST))
        [got] = speculative_generate(tiny_target, proposer, [prompt], stop=stop, k=4)
        return got, proposer

    (tree, _), (hybrid, proposer) = run(EagleProposer), run(EagleLookupProposer)
    assert_greedy_equal(tiny_target, prompt, hybrid.token_ids, tree.token_ids)
    assert hybrid.stats.target_forwards < tree.stats.target_forwards
    assert proposer.lookup.judged() > 0  # lookup's table learns from the tree steps too


def test_eagle_lookup_runs_through_the_engine_and_sampling_stays_with_eagle(tiny_target, trained_dir):
    engine = Engine.from_models(LoadedModel(tiny_target, None, "tiny"), costs=EagleCosts(CPU_LIKE, 0.05),
                                config=EngineConfig(eagle_dir=str(trained_dir)))
    prompt, stop = PROMPTS[0] * 3, StopConditions(max_new_tokens=16, eos_token_ids=(10_000,))
    [got] = engine.generate_ids([prompt], "eagle-lookup", stop=stop, k=4)
    [want] = engine.generate_ids([prompt], "plain", stop=stop)
    assert_greedy_equal(tiny_target, prompt, got.token_ids, want.token_ids)
    proposer = engine.proposer_factory("eagle-lookup")()
    shared = proposer.lookup  # (shared by the method's proposers)
    before = shared.judged()
    assert before > 0  # the greedy run above met lookup's chains
    sampled = SamplingParams(temperature=1.0, seed=3)
    [s] = speculative_generate(tiny_target, proposer, [prompt], sampling=sampled, stop=stop, k=4)
    assert s.stats.drafted > 0 and shared.judged() == before  # a sampled row drafts with EAGLE alone


def test_auto_weighs_eagle_lookup_once_it_has_run_here(tiny_target, trained_dir):
    costs = EagleCosts(GPU_LIKE_COST, 0.1)  # a GPU-like verify cost
    engine = Engine.from_models(LoadedModel(tiny_target, None, "tiny"), costs=costs,
                                config=EngineConfig(eagle_dir=str(trained_dir)))
    costs.add_acceptance(tiny_target, "prompt-lookup", drafted=1000, accepted=10)  # lookup measured poor here
    assert engine.resolve_method("auto") == "plain"
    costs.add_acceptance(tiny_target, "eagle-lookup", drafted=40_000, accepted=39_000, proposer=str(trained_dir))
    assert engine.resolve_method("auto") == "eagle-lookup"
    stop = StopConditions(max_new_tokens=16, eos_token_ids=(10_000,))
    [got] = engine.generate_ids([PROMPTS[0]], "auto", stop=stop, k=4)
    [want] = engine.generate_ids([PROMPTS[0]], "plain", stop=stop)
    assert_greedy_equal(tiny_target, PROMPTS[0], got.token_ids, want.token_ids)
    # k auto: the cost-aware schedule at EAGLE's step cost, from the acceptance measured here
    schedule = engine.k_schedule("eagle-lookup", "auto")
    assert schedule.draft_cost == 0.1 and schedule.k_min == 0 and schedule.prior_alpha > 0.9
    [auto_k] = engine.generate_ids([PROMPTS[0]], "eagle-lookup", stop=stop, k="auto")
    assert_greedy_equal(tiny_target, PROMPTS[0], auto_k.token_ids, want.token_ids)


def test_k_auto_leaves_a_draft_that_cannot_pay_idle_but_for_probes(tiny_target, trained_dir):
    """On a verify cost where a forward over two tokens costs nearly two (llama.cpp on a CPU),
    an EAGLE draft accepted a third of the time cannot pay: k auto runs plain steps, drafting on
    a probe now and then, and the output is plain's."""
    from tests.conftest import LLAMACPP_CPU_COST

    costs = EagleCosts(LLAMACPP_CPU_COST, 0.15)
    engine = Engine.from_models(LoadedModel(tiny_target, None, "tiny"), costs=costs,
                                config=EngineConfig(eagle_dir=str(trained_dir)))
    costs.add_acceptance(tiny_target, "eagle", drafted=3000, accepted=1000, proposer=str(trained_dir))
    stop = StopConditions(max_new_tokens=32, eos_token_ids=(10_000,))
    [got] = engine.generate_ids([PROMPTS[2]], "eagle", stop=stop, k="auto")
    [want] = engine.generate_ids([PROMPTS[2]], "plain", stop=stop)
    assert_greedy_equal(tiny_target, PROMPTS[2], got.token_ids, want.token_ids)
    schedule = engine.k_schedule("eagle", "auto")
    assert schedule.k_min == 0 and schedule.next(1, 1, 0, 0, 1, step=3) == 0  # plain steps: the draft idle
    assert schedule.next(0, 0, 0, step=8) == 1  # but for a probe now and then
