"""The coordinator's `auto`: drafting or the target alone, whichever has cost less per emitted
token, each measured first, the slower tried again ever more rarely (in seconds of the faster
way) while it keeps losing, and never taking more than its share of the time."""

import pytest

from specdec.step_choice import DRAFT, LOCAL, StepRates


def _drive(rates: StepRates, cost: dict, steps: int) -> list[str]:
    """Take `steps` steps, each way costing cost[way] seconds per token (8 tokens a step)."""
    taken = []
    for _ in range(steps):
        way = rates.choose(draft_available=True)
        rates.record(way, cost[way] * 8, 8)
        taken.append(way)
    return taken


def test_without_a_draft_every_step_is_local():
    rates = StepRates()
    assert {rates.choose(draft_available=False) for _ in range(50)} == {LOCAL}


def test_each_way_is_measured_once_then_the_faster_is_taken():
    taken = _drive(StepRates(), {LOCAL: 0.010, DRAFT: 0.025}, 12)
    assert taken[:2] == [LOCAL, DRAFT] and set(taken[2:]) == {LOCAL}


def test_the_slower_way_is_tried_ever_more_rarely_while_it_keeps_losing():
    rates = StepRates(explore_after_s=1.0, max_explore_after_s=8.0, max_share=1.0)
    taken = _drive(rates, {LOCAL: 0.025, DRAFT: 0.010}, 1500)  # a step: LOCAL 0.2 s, DRAFT 0.08 s
    tries = [i for i, way in enumerate(taken) if way == LOCAL][1:]  # after its first measurement
    gaps = [b - a for a, b in zip(tries, tries[1:])]  # steps between tries: 1, 2, 4, 8 s of DRAFT
    assert len(gaps) >= 6
    for a, b in zip(gaps[:2], gaps[1:3]):
        assert 1.8 * a <= b <= 2.2 * a
    assert max(gaps[2:]) - min(gaps[2:]) <= 1  # then max_explore_after_s apart
    assert taken.count(DRAFT) / len(taken) > 0.98


def test_the_wait_is_counted_in_seconds_not_steps():
    """A step may be a whole answer (a unary request's one Decode): the slower way is tried again
    after as much time whether the faster way's steps are short or long."""
    for tokens in (1, 64):
        rates = StepRates(explore_after_s=3.0, max_share=1.0)
        cost = {LOCAL: 0.010, DRAFT: 0.030}
        steps = 0
        for _ in range(5000):
            way = rates.choose(draft_available=True)
            rates.record(way, cost[way] * tokens, tokens)
            steps += 1
            if way == DRAFT and steps > 2:
                break
        waited = (steps - 3) * cost[LOCAL] * tokens  # LOCAL's seconds between DRAFT's measurement and its try
        assert 3.0 - 1e-6 <= waited <= 3.0 + cost[LOCAL] * tokens + 1e-6


def test_explorations_take_at_most_their_share_of_the_time():
    """A slower way whose steps cost far more than the faster way's (a draft that must be loaded,
    a long block) is tried only once the faster way has run 1 / max_share times as long."""
    rates = StepRates(explore_after_s=0.3, max_explore_after_s=0.3, max_share=0.05)
    cost = {LOCAL: 0.010, DRAFT: 0.100}  # seconds per token: a DRAFT step costs 10 LOCAL steps
    taken = _drive(rates, cost, 2000)
    seconds = {way: 8 * cost[way] * taken.count(way) for way in cost}
    assert taken.count(DRAFT) >= 3  # still tried again and again
    assert seconds[DRAFT] <= 0.06 * (seconds[LOCAL] + seconds[DRAFT])
    # skipped steps (the one that loads the draft) count as well
    rates = StepRates(explore_after_s=0.1, max_explore_after_s=0.1, max_share=0.05)
    _drive(rates, cost, 2)
    skipped = local = 0
    for _ in range(2000):
        if rates.choose(draft_available=True) == DRAFT:
            rates.skipped(DRAFT, 1.0)  # 1 s each, never typical
            skipped += 1
        else:
            rates.record(LOCAL, 0.08, 8)
            local += 1
    assert skipped >= 4 and 1.0 * skipped <= 0.06 * (0.08 * local + 1.0 * skipped)


def test_a_way_that_becomes_faster_is_taken_again():
    rates = StepRates(explore_after_s=0.3)
    _drive(rates, {LOCAL: 0.010, DRAFT: 0.025}, 40)
    assert rates.faster() == LOCAL
    later = _drive(rates, {LOCAL: 0.040, DRAFT: 0.025}, 200)  # the target got busy
    assert rates.faster() == DRAFT and later[-50:].count(DRAFT) > 45


def test_the_draft_is_loaded_into_new_sessions_only_while_it_is_the_faster_way():
    rates = StepRates()
    assert not rates.wants_draft()  # not measured yet: the first drafted step loads it
    _drive(rates, {LOCAL: 0.010, DRAFT: 0.025}, 5)
    assert not rates.wants_draft()
    _drive(rates, {LOCAL: 0.040, DRAFT: 0.010}, 200)
    assert rates.wants_draft()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        StepRates(weight=0)
    with pytest.raises(ValueError):
        StepRates(explore_after_s=0)
    with pytest.raises(ValueError):
        StepRates(max_share=0)


def test_an_exploration_whose_step_was_not_typical_is_taken_once_more_then_given_up():
    """The step that loads a session into the draft is not recorded; the exploration takes the
    next one (warm), and an exploration that never gets a typical step does not stay open."""
    rates = StepRates(explore_after_s=0.2, max_share=1.0)
    _drive(rates, {LOCAL: 0.010, DRAFT: 0.025}, 2)  # both measured: LOCAL faster
    ways = []
    for _ in range(4):
        ways.append(rates.choose(draft_available=True))
        if ways[-1] == LOCAL:
            rates.record(LOCAL, 0.08, 8)
    assert ways[-1] == DRAFT  # the exploration
    rates.skipped(DRAFT)  # cold: loaded the draft
    assert rates.choose(draft_available=True) == DRAFT  # once more
    rates.record(DRAFT, 0.2, 8)
    assert rates.choose(draft_available=True) == LOCAL
    # An exploration skipped twice is given up, and the next comes after the usual gap.
    while (way := rates.choose(draft_available=True)) == LOCAL:
        rates.record(LOCAL, 0.08, 8)
    rates.skipped(DRAFT)
    assert rates.choose(draft_available=True) == DRAFT
    rates.skipped(DRAFT)
    after = []
    for _ in range(6):
        after.append(rates.choose(draft_available=True))
        if after[-1] == LOCAL:
            rates.record(LOCAL, 0.08, 8)
    assert after[:3] == [LOCAL] * 3 and DRAFT in after


def test_no_exploration_or_first_measurement_where_it_may_not():
    """A session's first token (the latency a streaming client sees) takes the way known faster,
    or the target alone while a way is unmeasured; explorations wait for a later step."""
    rates = StepRates(explore_after_s=0.1, max_share=1.0)
    assert rates.choose(True, may_explore=False) == LOCAL
    rates.record(LOCAL, 0.08, 8)
    assert rates.choose(True, may_explore=False) == LOCAL  # DRAFT unmeasured: not measured here
    assert rates.choose(True) == DRAFT
    rates.record(DRAFT, 0.02, 8)  # DRAFT faster
    assert rates.choose(True, may_explore=False) == DRAFT
    for _ in range(20):
        rates.record(DRAFT, 0.02, 8)  # time passes: an exploration is due
    assert rates.choose(True, may_explore=False) == DRAFT
    assert rates.choose(True) == LOCAL  # the due exploration, at the next step that may


def test_a_hopeless_draft_is_neither_measured_first_nor_explored_until_the_long_wait():
    """A draft whose measured acceptance could not pay even for free is left idle; after
    max_explore_after_s of the target alone's time it is tried once (the prompts may have
    changed), and then left idle for as long again."""
    rates = StepRates(explore_after_s=1.0, max_explore_after_s=10.0, max_share=1.0)
    taken = []
    for _ in range(300):  # 0.1 s a LOCAL step, 0.3 s a DRAFT step
        way = rates.choose(draft_available=True, draft_hopeless=True)
        rates.record(way, {LOCAL: 0.1, DRAFT: 0.3}[way], 1)
        taken.append(way)
    tries = [i for i, way in enumerate(taken) if way == DRAFT]
    assert len(tries) == 2, tries
    assert 99 <= tries[0] <= 102 and 99 <= tries[1] - tries[0] <= 102


def test_a_hopeless_verdict_does_not_override_a_draft_measured_faster():
    rates = StepRates()
    rates.record(LOCAL, 0.3, 1)
    rates.record(DRAFT, 0.1, 1)
    assert rates.choose(draft_available=True, draft_hopeless=True) == DRAFT
