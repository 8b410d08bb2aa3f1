"""A target service on llama.cpp (a tiny GGUF written by the test): concurrent sessions through
draft, target and coordinator give exactly this backend's plain greedy output, with the torch
draft and with the target-side fallback (plain: llama.cpp runs no tree methods)."""

from __future__ import annotations

import asyncio

import pytest

from specdec.errors import InvalidRequest
from tests.conftest import assert_greedy_equal, gguf_copy, plain
from tests.services.stack import FAST, local_stack, mean_batch_size, run

PROMPTS = [[5, 6, 7, 8, 9], [3, 4, 10, 11, 12, 13, 14], [20, 21, 22], [40, 41, 42, 43], [7, 7, 7]]


@pytest.fixture(scope="module")
def gguf_target(long_target, tmp_path_factory):
    return gguf_copy(long_target, tmp_path_factory.mktemp("gguf") / "long.gguf", context=512)


@pytest.mark.parametrize("method", ["draft", "auto"])
def test_concurrent_sessions_on_a_llamacpp_target_equal_its_plain_decoding(redis_url, gguf_target, good_draft, method):
    async def scenario():
        async with local_stack(redis_url, gguf_target, good_draft if method == "draft" else None) as st:
            outs = await asyncio.gather(*(st.client.generate(st.client.request(token_ids=p, max_tokens=30,
                                                                                method=method)) for p in PROMPTS))
            return outs, mean_batch_size(st.targets[0].core.metrics), st.targets[0].core.available_methods()

    outs, batch, methods = run(scenario())
    assert "lookahead" not in methods  # trees: not on llama.cpp
    for p, out in zip(PROMPTS, outs):
        want = plain(gguf_target, p, 30)
        assert_greedy_equal(gguf_target, p, out.token_ids, want.token_ids)
        assert out.finish_reason == want.finish_reason
    if method == "draft":
        assert sum(o.stats["accepted"] for o in outs) > 0, "nothing accepted: rollback paths did not run"
        assert all(o.stats["fallback_steps"] == 0 for o in outs)
    else:
        assert all(o.stats["fallback_steps"] > 0 for o in outs)
    assert batch > 1, "no two sessions were ever verified in one batch: the in-turn path did not run"


def test_a_tree_method_on_a_llamacpp_target_is_refused_with_a_clear_message(redis_url, gguf_target):
    async def scenario():
        async with local_stack(redis_url, gguf_target) as st:
            return await st.client.generate(st.client.request(token_ids=PROMPTS[0], max_tokens=8, method="lookahead"))

    with pytest.raises(InvalidRequest, match="unknown method 'lookahead'; choose one of .*prompt-lookup") as err:
        run(scenario())
    assert "lookahead" not in str(err.value).split("choose one of")[1]


@pytest.fixture(scope="module")
def gguf_draft(good_draft):
    """good_draft moved onto llama.cpp as the draft service does it (a GGUF written once, probed)."""
    from draft_service.models import on_llamacpp

    return on_llamacpp(good_draft)


def test_a_draft_on_llamacpp_drafts_concurrent_sessions_side_by_side_and_equals_plain(redis_url, long_target,
                                                                                      gguf_draft):
    """The draft service on llama.cpp (each session its own context: run_each, no stacked
    batch): concurrent sessions, greedy and seeded sampling, give the torch target's own output."""
    from specdec.types import SamplingParams

    sampled = SamplingParams(temperature=0.8, seed=11)

    async def scenario():
        async with local_stack(redis_url, long_target, gguf_draft, settings=FAST) as st:
            outs = await asyncio.gather(*(st.client.generate(st.client.request(token_ids=p, max_tokens=30,
                                                                                method="draft")) for p in PROMPTS))
            twice = [await st.client.generate(st.client.request(token_ids=PROMPTS[0], max_tokens=20, method="draft",
                                                                sampling=sampled)) for _ in range(2)]
            return outs, twice, mean_batch_size(st.drafts[0].core.metrics)

    outs, twice, batch = run(scenario())
    for p, out in zip(PROMPTS, outs):
        assert_greedy_equal(long_target, p, out.token_ids, plain(long_target, p, 30).token_ids)
    assert sum(o.stats["accepted"] for o in outs) > 0 and all(o.stats["fallback_steps"] == 0 for o in outs)
    assert batch > 1, "no two sessions ever drafted in one call: the side-by-side path did not run"
    assert twice[0].token_ids == twice[1].token_ids and len(twice[0].token_ids) == 20
    assert twice[0].stats["drafted"] > 0


def test_a_draft_is_converted_to_gguf_once(good_draft, tmp_path):
    from specdec.drafts import draft_gguf

    first = draft_gguf(good_draft, tmp_path)
    stamp = first.stat().st_mtime_ns
    assert draft_gguf(good_draft, tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary file left


def test_a_gguf_draft_on_a_torch_backend_is_refused_with_what_to_do_instead(tmp_path):
    from draft_service.models import load_draft
    from specdec.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="--backend llamacpp"):
        load_draft(str(tmp_path / "draft.gguf"), backend="fast")


def test_auto_serves_the_draft_on_the_backend_whose_step_measured_cheaper_and_keeps_the_verdict(good_draft, tmp_path):
    """Which backend wins depends on the machine, so the test asserts only that the served draft
    is the one the kept verdict names, that the verdict is reused, and that it is followed."""
    import json

    from draft_service.models import faster_of
    from specdec.costmodel import CostStore

    def store():
        return CostStore(tmp_path, others_busy=lambda measure: (measure(), 0.0))  # (a test suite's own load: keep it)

    def served(lm) -> str:
        return "llamacpp" if lm.backend == "llamacpp" else "torch"

    first = served(faster_of(good_draft, store()))
    [kept] = list(tmp_path.glob("draft_backend-*.json"))
    assert json.loads(kept.read_text())["value"] == first
    assert served(faster_of(good_draft, store())) == first
    other = "torch" if first == "llamacpp" else "llamacpp"
    data = json.loads(kept.read_text())
    kept.write_text(json.dumps({**data, "value": other}))
    assert served(faster_of(good_draft, store())) == other


@pytest.mark.parametrize("join", [True, False])
def test_concurrent_sessions_on_llamacpp_share_one_decode_a_step_and_still_equal_plain(redis_url, long_target,
                                                                                      tmp_path, join):
    """With join_sessions on, concurrent sessions' plain steps on a llama.cpp target go
    into one llama_decode on a shared context; their outputs stay this backend's plain decoding
    (tie-aware), and the shared context is freed once no session holds it. Off: never joined."""
    import time

    from target_service.core import TargetSettings

    lm = gguf_copy(long_target, tmp_path / "joined.gguf", threads=2, context=512)  # two shared contexts
    prompts = PROMPTS + [[9, 8, 7, 6], [30, 31, 32, 33, 34, 35]]

    async def scenario():
        async with local_stack(redis_url, lm, None, target_settings=TargetSettings(join_sessions=join)) as st:
            return await asyncio.gather(*(st.client.generate(st.client.request(token_ids=p, max_tokens=40,
                                                                                method="plain")) for p in prompts))

    outs = run(scenario())
    for p, out in zip(prompts, outs):
        assert_greedy_equal(lm, p, out.token_ids, plain(lm, p, 40).token_ids)
    if not join:
        assert lm.shared == [] and lm.joined_decodes == 0
        return
    assert lm.joined_decodes > 0, "no two sessions' steps ever went into one llama_decode"
    assert len(lm.shared) == 2 and all(sh.made for sh in lm.shared), "the sessions did not spread over both contexts"
    assert sum(sh.made for sh in lm.shared) >= 1
    end = time.monotonic() + 15
    while any(sh.ctx is not None for sh in lm.shared) and time.monotonic() < end:  # freed after their last session
        time.sleep(0.2)
    assert all(sh.ctx is None and sh.in_use == 0 for sh in lm.shared)
