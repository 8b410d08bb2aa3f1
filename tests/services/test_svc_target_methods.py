"""Target-side methods (Decode on the target service's core) when sessions share a batch."""

from __future__ import annotations

import asyncio

import torch

from specdec.proposers.lookahead import LookaheadConfig, LookaheadProposer
from specdec.sessions import token_digest
from specdec.types import DecodeResult, SamplingParams
from specdec.service.sync import Position
from target_service.core import TargetCore, TargetSettings
from tests.services.stack import mean_batch_size, run

PROMPTS = ([5, 6, 7, 8, 9, 5, 6, 7], [30, 31, 32, 33, 30, 31])
# The pool filled from the Jacobi window alone: whatever it accepts comes from the window's
# feedback (observe), which is what batching must not lose.
WINDOW_ONLY = {"lookahead": lambda: LookaheadProposer(LookaheadConfig(pool_from_context=False))}
# A long batch window: the two sessions' steps always share one forward when run together.
BATCH_OF_TWO = TargetSettings(max_batch=2, batch_window_ms=500.0)


async def _decode(core: TargetCore, session_id: str, prompt: list[int], max_tokens: int = 48) -> DecodeResult:
    await core.prefill(session_id, prompt)
    pos = Position(len(prompt), (), token_digest(prompt))
    return await core.decode(session_id, pos, max_tokens, "lookahead", SamplingParams())


def test_lookahead_sessions_verified_together_reach_the_same_tau_as_each_alone(long_target):
    async def scenario():
        alone = []
        for i, p in enumerate(PROMPTS):
            core = TargetCore(long_target, BATCH_OF_TWO, methods=WINDOW_ONLY)
            try:
                alone.append(await _decode(core, f"alone-{i:04d}", p))
            finally:
                await core.close()
        core = TargetCore(long_target, BATCH_OF_TWO, methods=WINDOW_ONLY)
        try:
            together = await asyncio.gather(*(_decode(core, f"together-{i:04d}", p) for i, p in enumerate(PROMPTS)))
            batched = mean_batch_size(core.metrics)
        finally:
            await core.close()
        return alone, together, batched

    alone, together, batched = run(scenario())
    assert batched > 1.5, "the sessions' steps were not batched together"
    assert all(a.num_accepted > 0 for a in alone), "lookahead accepted nothing alone: the test shows nothing"
    for a, t in zip(alone, together):
        assert t == a  # the same tokens, forwards, drafted and accepted


class _WantHidden:
    """The target, recording whether each forward asked for hidden states."""

    def __init__(self, lm):
        self._lm, self.asked = lm, []

    def __getattr__(self, name):
        return getattr(self._lm, name)

    def forward(self, *args, want_hidden=False, **kwargs):
        self.asked.append(want_hidden)
        return self._lm.forward(*args, want_hidden=want_hidden, **kwargs)


def test_verify_asks_for_no_hidden_state_and_a_hidden_reading_method_takes_over_after_one_plain_step(long_target):
    """Hidden states cost a forward on llama.cpp: only a Decode step whose proposer reads them (Medusa
    heads) asks for one. A session that moves from the draft (Verify) to such a method first takes a
    plain step, then its proposer sees the state that produced the last token; output stays plain's."""
    import torch

    from specdec.decode import plain_generate
    from specdec.types import StopConditions
    from tests.unit.test_proposer_hooks import HiddenProbe

    prompt = [5, 6, 7, 8, 9]
    want = plain_generate(long_target, [prompt], stop=StopConditions(max_new_tokens=9))[0].token_ids
    target, probe = _WantHidden(long_target), HiddenProbe()

    async def scenario():
        core = TargetCore(target, methods={"hidden_probe": lambda: probe})
        try:
            await core.prefill("session-1", prompt)
            tokens = list(prompt)
            for draft in ((), (want[1], want[2]), (3, 4)):  # a plain step, an accepted block, a rejected one
                v = await core.verify("session-1", Position(len(tokens), (), token_digest(tokens)), draft, None,
                                      SamplingParams(), None)
                tokens += v.emitted
            verified = len(target.asked)
            res = await core.decode("session-1", Position(len(tokens), (), token_digest(tokens)), 9 - (len(tokens) - 5),
                                    "hidden_probe", SamplingParams())
            return tokens, list(res.emitted), verified
        finally:
            await core.close()

    verified_tokens, decoded, verified = run(scenario())
    assert (verified_tokens + decoded)[len(prompt):] == list(want)
    assert target.asked[:verified] == [False] * verified and all(target.asked[verified:])
    assert probe.seen and len(probe.seen[0][0]) == len(verified_tokens) + 1  # after one plain Decode step
    for toks, hidden in probe.seen:
        ref = long_target.forward(long_target.new_cache(1), torch.tensor([list(toks[:-1])]), want_hidden=True)
        assert torch.allclose(hidden, ref.hidden[0, -1], atol=1e-5)


def test_a_long_decode_goes_on_in_the_model_thread_yet_lets_another_session_in(long_target):
    """A Decode takes its forwards one after another on the model thread (no hop back to the event
    loop per token), but never while another session waits: a session that arrives meanwhile is
    served between two of its tokens, and both outputs are plain decoding's."""
    from specdec.decode import plain_generate
    from specdec.types import StopConditions

    long_prompt, short_prompt = PROMPTS

    async def scenario():
        core = TargetCore(long_target, TargetSettings(prefix_cache_mb=0), methods={})
        try:
            await core.prefill("long-0001", long_prompt)
            pos = Position(len(long_prompt), (), token_digest(long_prompt))
            long = asyncio.create_task(core.decode("long-0001", pos, 400, "plain", SamplingParams()))
            await asyncio.sleep(0.05)
            assert not long.done(), "the long Decode ended before the other session came: the test shows nothing"
            await core.prefill("short-0002", short_prompt)
            short = await core.decode("short-0002", Position(len(short_prompt), (), token_digest(short_prompt)), 4,
                                      "plain", SamplingParams())
            served_between = not long.done()
            return await long, short, served_between, mean_batch_size(core.metrics)
        finally:
            await core.close()

    long_out, short_out, served_between, per_forward = run(scenario())
    assert served_between, "the other session waited for the whole long Decode"
    assert per_forward >= 1.0
    want = plain_generate(long_target, [long_prompt, short_prompt], stop=StopConditions(max_new_tokens=400))
    assert list(long_out.emitted) == list(want[0].token_ids)
    assert list(short_out.emitted) == list(want[1].token_ids)[:4]


# --- EAGLE on the target: the proposer reads the target's features -----------------------------

def _eagle_scenario(target, proposer, prompt, total: int, verify_drafts=((),), rollback: bool = False):
    """Prefill, a few Verify steps (which compute no features), then Decode with the proposer in
    two calls (the coordinator's chunks), the second by a caller two tokens behind the service
    when `rollback`. -> the committed tokens after the prompt."""
    async def scenario():
        core = TargetCore(target, TargetSettings(prefix_cache_mb=0), methods={"probe": lambda: proposer})
        try:
            await core.prefill("eagle-0001", prompt)
            tokens = list(prompt)
            for draft in verify_drafts:
                v = await core.verify("eagle-0001", Position(len(tokens), (), token_digest(tokens)), draft, None,
                                      SamplingParams(), None)
                tokens += v.emitted
            for call in range(2):
                if call == 1 and rollback:
                    tokens = tokens[:-2]
                n = 5 if call == 0 else total - (len(tokens) - len(prompt))
                res = await core.decode("eagle-0001", Position(len(tokens), (), token_digest(tokens)), n, "probe",
                                        SamplingParams())
                tokens += res.emitted
            return tokens[len(prompt):]
        finally:
            await core.close()
    return run(scenario())


def test_eagle_decodes_on_the_target_service_as_plain_and_gets_every_feature_once(long_target):
    """A feature-reading proposer (EAGLE) in the target service's Decode: whatever came before
    (Verify steps that computed no features, a Decode split in two calls, a caller two tokens
    behind), the features it was handed add up to the target's states at every committed
    position but the last, as one fresh forward computes them, and greedy output is plain's."""
    from specdec.decode import plain_generate
    from specdec.testing import perturbed_copy
    from specdec.types import StopConditions
    from tests.unit.test_eagle import FeatureProbe

    prompt, total = [5, 6, 7, 8, 9, 10, 11], 30
    want = list(plain_generate(long_target, [prompt], stop=StopConditions(max_new_tokens=total))[0].token_ids)
    for verify_drafts, rollback in ((((),), False), (((), (want[1], want[2]), (3, 4)), True)):
        probe = FeatureProbe(perturbed_copy(long_target, noise=0.3, seed=1))
        got = _eagle_scenario(long_target, probe, prompt, total, verify_drafts, rollback=rollback)
        assert got == want
        [calls] = probe.seen.values()
        assert sum(1 for _ in calls) > 2
        # Since the last time the session was read again (a Verify before, the rollback), every
        # call's features continue the ones before: in all, one per committed position but the last.
        starts = [i for i, (toks, feats) in enumerate(calls) if feats.shape[0] == len(toks) - 1]
        handed = torch.cat([f for _, f in calls[starts[-1]:]])
        toks = calls[-1][0]
        assert handed.shape[0] == len(toks) - 1
        ref = long_target.forward(long_target.new_cache(1), torch.tensor([list(toks[:-1])]), want_hidden=True).hidden[0]
        torch.testing.assert_close(handed, ref, atol=1e-4, rtol=1e-4)
        if rollback:
            assert len(starts) >= 2, "the rolled-back session was not read again"


def test_a_draft_reading_tap_layers_gets_the_target_s_residuals_beside_every_feature(long_target):
    """A feature-reading proposer that asks for the residuals after a target layer (an EAGLE
    draft with tap_layers), on the fast backend: whatever came before (Verify steps, a caller
    two tokens behind), each feature row it was handed carries the residual after that layer
    as one fresh pass computes it, and greedy output is plain's."""
    import copy

    from specdec.backends.fast import FastLlamaLM
    from specdec.decode import plain_generate
    from specdec.testing import perturbed_copy
    from specdec.types import StopConditions
    from tests.unit.test_eagle import FeatureProbe

    class TapProbe(FeatureProbe):
        tap_layers = (0,)

    fast = FastLlamaLM(copy.deepcopy(long_target.model), name=long_target.name)
    prompt, total = [5, 6, 7, 8, 9, 10, 11], 30
    want = list(plain_generate(fast, [prompt], stop=StopConditions(max_new_tokens=total))[0].token_ids)
    probe = TapProbe(perturbed_copy(long_target, noise=0.3, seed=1))
    got = _eagle_scenario(fast, probe, prompt, total, ((), (want[1], want[2]), (3, 4)), rollback=True)
    assert got == want
    [calls] = probe.seen.values()
    starts = [i for i, (toks, feats) in enumerate(calls) if feats.shape[0] == len(toks) - 1]
    handed = torch.cat([f for _, f in calls[starts[-1]:]])
    toks = torch.tensor([list(calls[-1][0][:-1])])
    assert handed.shape == (toks.shape[1], 2 * 48)
    ref = fast.forward(fast.new_cache(1), toks, want_hidden=True).hidden[0]
    torch.testing.assert_close(handed[:, :48], ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(handed[:, 48:], fast.layer_states(toks, (0,))[0], atol=1e-4, rtol=1e-4)


def test_the_eagle_method_decodes_on_the_target_service_as_plain(long_target):
    from specdec.decode import plain_generate
    from specdec.eagle import build_eagle
    from specdec.proposers import EagleProposer
    from specdec.types import StopConditions

    prompt, total = [40, 41, 42, 43], 24
    want = list(plain_generate(long_target, [prompt], stop=StopConditions(max_new_tokens=total))[0].token_ids)
    eagle = EagleProposer(build_eagle(long_target, torch.arange(0, 96, 2)))
    assert _eagle_scenario(long_target, eagle, prompt, total) == want


def test_eagle_lookup_decodes_on_the_target_service_as_plain(long_target):
    """eagle-lookup in the target's Decode: on a prompt that repeats itself lookup's chain is sent
    (and accepted), EAGLE's state follows it, and greedy output is plain's."""
    from specdec.decode import plain_generate
    from specdec.eagle import build_eagle
    from specdec.proposers import EagleLookupProposer
    from specdec.proposers.eagle import DepthChoice
    from specdec.types import StopConditions

    seed, total = [40, 41, 42, 43], 24
    answer = list(plain_generate(long_target, [seed], stop=StopConditions(max_new_tokens=12))[0].token_ids)
    prompt = seed + answer + seed  # the answer to its start comes again: lookup copies it
    want = list(plain_generate(long_target, [prompt], stop=StopConditions(max_new_tokens=total))[0].token_ids)
    hybrid = EagleLookupProposer(build_eagle(long_target, torch.arange(0, 96, 2)),
                                 depth=DepthChoice(c=0.05, v={1: 1.0, 2: 1.2, 3: 1.4, 5: 1.8}))
    assert _eagle_scenario(long_target, hybrid, prompt, total) == want
    assert hybrid.lookup.judged() > 0, "lookup's chain was never sent"


class _Counted:
    """The target, counting its forwards and prefills (each a pass over the model)."""

    def __init__(self, lm):
        self._lm, self.passes = lm, 0

    def __getattr__(self, name):
        return getattr(self._lm, name)

    def forward(self, *args, **kwargs):
        self.passes += 1
        return self._lm.forward(*args, **kwargs)

    def prefill(self, *args, **kwargs):
        self.passes += 1
        return self._lm.prefill(*args, **kwargs)


def test_a_new_session_takes_its_first_token_from_its_load_with_no_forward_of_its_own(long_target):
    """A session's load feeds every committed token and keeps the logits after the last: its first
    plain token needs no forward (the first token of a request costs one pass, as plain decoding's
    does); a draft to verify next drops that token from the cache and feeds it with the draft.
    Outputs are plain decoding's either way."""
    from specdec.decode import plain_generate
    from specdec.types import StopConditions

    prompt = PROMPTS[0]
    target = _Counted(long_target)
    want = list(plain_generate(long_target, [prompt], stop=StopConditions(max_new_tokens=6))[0].token_ids)

    async def scenario():
        core = TargetCore(target, TargetSettings(prefix_cache_mb=0, history_tokens=0), methods={})
        try:
            first = await core.decode("plain-0001", Position(len(prompt), tuple(prompt), token_digest(prompt)), 1,
                                      "plain", SamplingParams())
            passes_first = target.passes
            rest = await core.decode("plain-0001", Position(len(prompt) + 1, (), token_digest(prompt + list(first.emitted))),
                                     5, "plain", SamplingParams())
            await core.prefill("draft-0002", prompt)  # then a Verify with a draft: the token is fed again with it
            v = await core.verify("draft-0002", Position(len(prompt), (), token_digest(prompt)), want[:3], None,
                                  SamplingParams(), None)
            return first, passes_first, rest, v
        finally:
            await core.close()

    first, passes_first, rest, v = run(scenario())
    assert passes_first == 1  # the load's prefill, nothing else
    assert list(first.emitted) + list(rest.emitted) == want
    assert v.num_accepted == 3 and list(v.emitted) == want[:4]


def test_on_llamacpp_the_step_after_a_load_verifies_its_draft_as_on_torch(long_target, tmp_path):
    """Every width rounds alike on specdec's llama.cpp (WIDTH_INVARIANT_ENV), so feeding a load's last
    token again with a draft gives it plain decoding's KV and logits: a Verify right after a
    Prefill judges its draft (with width-dependent kernels it was answered with the load's one
    token, none judged), and an EAGLE Decode reads its features on a scratch cache. Outputs are plain's."""
    from specdec.decode import plain_generate
    from specdec.testing import perturbed_copy
    from specdec.types import StopConditions
    from tests.conftest import gguf_copy
    from tests.unit.test_eagle import FeatureProbe

    lm = gguf_copy(long_target, tmp_path / "t.gguf", context=512, n_batch=16)
    prompt = PROMPTS[0]
    want = list(plain_generate(lm, [prompt], stop=StopConditions(max_new_tokens=30))[0].token_ids)

    async def scenario():
        core = TargetCore(lm, TargetSettings(prefix_cache_mb=0, history_tokens=0), methods={})
        try:
            await core.prefill("draft-0001", prompt)
            first = await core.verify("draft-0001", Position(len(prompt), (), token_digest(prompt)), want[:3], None,
                                      SamplingParams(), None)
            tokens = prompt + list(first.emitted)
            second = await core.verify("draft-0001", Position(len(tokens), (), token_digest(tokens)), want[4:7], None,
                                       SamplingParams(), None)
            return first, second
        finally:
            await core.close()

    first, second = run(scenario())
    assert first.num_drafted == 3 and first.num_accepted == 3 and list(first.emitted) == want[:4]
    assert second.num_accepted == 3 and list(second.emitted) == want[4:8]
    probe = FeatureProbe(perturbed_copy(long_target, noise=0.3, seed=1))
    assert _eagle_scenario(lm, probe, prompt, 30, verify_drafts=()) == want
    [calls] = probe.seen.values()
    handed = sum(feats.shape[0] for _, feats in calls)
    assert handed == len(calls[-1][0]) - 1  # one state per committed position but the last, each once
