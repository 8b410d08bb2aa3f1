"""The master test: under greedy settings speculative decoding emits exactly the plain tokens,
for every proposer, k and batch size, including stops that fall inside a drafted block."""

import pytest

from specdec.decode import KSchedule, plain_generate, speculative_generate
from specdec.proposers import DraftModelProposer, PromptLookupProposer
from specdec.types import StopConditions
from tests.conftest import check_greedy, assert_greedy_equal

PROMPTS = [[5, 17, 33, 2, 40], [9, 9], [60, 12, 7, 88, 3, 21, 45, 50, 11]]


def _proposer(name, draft):
    return DraftModelProposer(draft) if name == "draft_model" else PromptLookupProposer()


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", ["draft_model", "prompt_lookup"])
def test_speculative_equals_plain(tiny_target, tiny_draft, name, k, batch):
    got = check_greedy(tiny_target, _proposer(name, tiny_draft), PROMPTS[:batch], StopConditions(max_new_tokens=29), k)
    assert all(len(g.token_ids) == 29 for g in got)


@pytest.mark.parametrize("name", ["draft_model", "prompt_lookup"])
def test_eos_inside_a_drafted_block_stops_like_plain(tiny_target, tiny_draft, name):
    # Pick as EOS a token plain decoding emits mid-way through each prompt's answer.
    free = [plain_generate(tiny_target, [p], stop=StopConditions(max_new_tokens=30))[0].token_ids for p in PROMPTS]
    eos = free[0][11]
    stop = StopConditions(max_new_tokens=30, eos_token_ids=(eos,))
    got = check_greedy(tiny_target, _proposer(name, tiny_draft), PROMPTS, stop, k=8)
    assert got[0].finish_reason == "stop" and got[0].token_ids[-1] == eos
    assert len(got[0].token_ids) <= 12


@pytest.mark.parametrize("max_new", [1, 2, 7, 13])
def test_max_new_tokens_inside_a_block(tiny_target, tiny_draft, max_new):
    got = check_greedy(tiny_target, DraftModelProposer(tiny_draft), PROMPTS, StopConditions(max_new_tokens=max_new), k=5)
    assert [len(g.token_ids) for g in got] == [max_new] * 3


def test_adaptive_k_keeps_output_and_grows_on_acceptance(tiny_target, tiny_draft):
    schedule = KSchedule(k=2, adaptive=True, k_max=12)
    check_greedy(tiny_target, DraftModelProposer(tiny_draft), PROMPTS, StopConditions(max_new_tokens=40), schedule)
    # A perfect draft (the target itself) is always fully accepted: k must grow past its start of 2,
    # which caps tau at 3 without adaptation.
    got = check_greedy(tiny_target, DraftModelProposer(tiny_target), PROMPTS, StopConditions(max_new_tokens=40), schedule)
    assert min(g.stats.tau for g in got) > 3.0


CPU_LIKE_COST = {1: 1.0, 2: 1.02, 3: 1.57, 5: 1.7, 9: 2.8, 17: 3.3}  # measured shape (fast backend, 1 thread)


def test_cost_aware_k_keeps_output_and_follows_the_acceptance_rate(tiny_target, tiny_draft):
    schedule = KSchedule.cost_aware(CPU_LIKE_COST, draft_cost=0.1)
    assert schedule.k == 1  # a middling draft on a CPU-like cost curve: one token per step
    assert schedule.next(1, 1, 1, hits=60, trials=60) > 2  # a draft that is always right earns a longer block
    # a draft that is never right: plain steps (k = 0), with a one-token probe every 8th step
    assert [schedule.next(4, 4, 0, hits=0, trials=20, step=t) for t in (3, 8, 9)] == [0, 1, 0]
    check_greedy(tiny_target, DraftModelProposer(tiny_draft), PROMPTS, StopConditions(max_new_tokens=40), schedule)
    got = check_greedy(tiny_target, DraftModelProposer(tiny_target), PROMPTS, StopConditions(max_new_tokens=40), schedule)
    assert min(g.stats.tau for g in got) > 2.5  # k grew with the (perfect) acceptance
    # a draft that disagrees with the target on most tokens: it stops drafting, output unchanged
    from specdec.testing import perturbed_copy

    bad = perturbed_copy(tiny_target, noise=3.0, seed=7)
    got = check_greedy(tiny_target, DraftModelProposer(bad), PROMPTS, StopConditions(max_new_tokens=40),
                 KSchedule.cost_aware(CPU_LIKE_COST, draft_cost=0.3))
    assert all(g.stats.drafted < (g.stats.target_forwards - 1) / 2 for g in got)
    flat = KSchedule.cost_aware({1: 1.0, 65: 1.0}, draft_cost=0.0)
    assert flat.k == flat.k_max  # free verification and free drafts: draft as far as allowed


def test_stats_count_forwards_and_tokens(tiny_target, tiny_draft):
    (g,) = speculative_generate(tiny_target, DraftModelProposer(tiny_draft), [PROMPTS[0]],
                                stop=StopConditions(max_new_tokens=20), k=4)
    s = g.stats
    assert s.emitted == 20
    assert s.emitted == s.target_forwards + min(s.accepted, s.emitted - s.target_forwards)
    assert 0.0 <= s.alpha <= 1.0 and s.tau >= 1.0


@pytest.mark.parametrize("name", ["plain", "draft_model", "prompt_lookup"])
def test_tokens_are_streamed_per_row_in_order_as_they_are_committed(tiny_target, tiny_draft, name):
    streamed: dict[int, list[list[int]]] = {b: [] for b in range(len(PROMPTS))}

    def on_emit(row, tokens):
        streamed[row].append(list(tokens))

    stop = StopConditions(max_new_tokens=17)
    if name == "plain":
        got = plain_generate(tiny_target, PROMPTS, stop=stop, on_emit=on_emit)
    else:
        got = speculative_generate(tiny_target, _proposer(name, tiny_draft), PROMPTS, stop=stop, k=4, on_emit=on_emit)
    for b, result in enumerate(got):
        assert [t for block in streamed[b] for t in block] == list(result.token_ids)
        assert all(streamed[b])  # no empty calls
    if name == "draft_model":  # a step that accepts drafted tokens hands them over together
        assert any(len(block) > 1 for blocks in streamed.values() for block in blocks)
