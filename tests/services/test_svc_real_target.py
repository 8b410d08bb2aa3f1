"""Through the services on the real embedded target (SmolLM2-135M-Instruct): a chat prompt sent
as text (tokenized by the coordinator with the tokenizer the target serves) and a token-id
prompt, decoded concurrently (their Propose calls batch in the draft service, with the draft it
runs by default), give exactly plain decoding's tokens and text."""

from __future__ import annotations

import asyncio

import pytest

from specdec.decode import plain_generate
from specdec.models import format_prompt, load_model
from specdec.types import StopConditions
from tests.conftest import assert_greedy_equal
from tests.services.stack import local_stack, run

pytestmark = pytest.mark.real_model
N = 16


@pytest.fixture(scope="module")
def real():
    return load_model()


def test_real_target_through_the_services_equals_plain_decoding(redis_url, real):
    question = "What is the capital of France?"
    chat_ids = format_prompt(real.tokenizer, question)
    ids = format_prompt(real.tokenizer, "Name three rivers.")
    from draft_service.models import load_draft

    draft = load_draft(None)  # what `python -m draft_service` runs by default: the shipped draft

    async def scenario():
        # The target serves the model directory's tokenizer, as `python -m target_service` does.
        async with local_stack(redis_url, real.lm, draft, methods={}, tokenizer_dir=real.path) as st:
            return await asyncio.gather(
                st.client.generate(st.client.request(chat=[("user", question)], max_tokens=N)),
                st.client.generate(st.client.request(token_ids=ids, max_tokens=N)))

    chat_out, ids_out = run(scenario(), timeout=300)
    stop = StopConditions(max_new_tokens=N, eos_token_ids=real.lm.eos_token_ids)
    for prompt, out in ((chat_ids, chat_out), (ids, ids_out)):
        want = plain_generate(real.lm, [prompt], stop=stop)[0]
        assert_greedy_equal(real.lm, prompt, out.token_ids, want.token_ids)
    assert chat_out.text == real.tokenizer.decode(list(chat_out.token_ids), skip_special_tokens=True)
    assert "Paris" in chat_out.text


def test_the_draft_services_default_draft_runs_fast_and_can_batch_sessions():
    """The draft service batches concurrent Propose calls by stacking the sessions' KV caches
    (specdec.backends.kv_stack); its default draft on torch runs on the fast CPU forward and its
    caches must stack (a failure there would only show as the coordinator falling back to the
    target alone). (`--backend auto` may serve it on llama.cpp instead, where that measured faster.)"""
    from draft_service.models import load_draft
    from specdec.backends.fast import FastLlamaLM
    from specdec.backends.kv_stack import split_cache, stack_caches

    draft = load_draft(None, backend="fast")
    assert isinstance(draft, FastLlamaLM)
    caches = [draft.new_cache(1), draft.new_cache(1)]
    draft.prefill(caches[0], [[1, 2, 3]])
    draft.prefill(caches[1], [[4, 5]])
    rows = split_cache(stack_caches(caches, draft.new_cache), draft.new_cache)
    assert [int(r.valid.sum()) for r in rows] == [3, 2]


def test_the_gguf_target_on_llamacpp_through_the_services_equals_its_plain_decoding(redis_url, real, tmp_path):
    """`python -m target_service --backend llamacpp`: the embedded GGUF on llama.cpp, its tokenizer
    shipped to the coordinator (chat text in, text out), with the shipped torch draft on the draft
    service; two sessions at once, drafting and auto, equal llama.cpp plain."""
    from draft_service.models import load_draft
    from target_service.__main__ import build_parser, load_target, tokenizer_dir_of

    cpp = load_target(build_parser().parse_args(["--backend", "llamacpp"]))
    assert type(cpp.lm).__name__ == "LlamaCppLM"
    questions = ("Name three rivers.", "Write a haiku about the sea.")
    keep: list = []

    async def scenario():
        async with local_stack(redis_url, cpp.lm, load_draft(None), tokenizer_dir=tokenizer_dir_of(cpp, keep)) as st:
            return await asyncio.gather(*(st.client.generate(st.client.request(chat=[("user", q)], max_tokens=N,
                                                                                method=m))
                                          for q in questions for m in ("draft", "auto")))

    outs = run(scenario(), timeout=300)
    stop = StopConditions(max_new_tokens=N, eos_token_ids=cpp.lm.eos_token_ids)
    for i, out in enumerate(outs):
        prompt = format_prompt(real.tokenizer, questions[i // 2])
        want = plain_generate(cpp.lm, [prompt], stop=stop)[0]
        assert_greedy_equal(cpp.lm, prompt, out.token_ids, want.token_ids, 0.05)  # llama.cpp's tie margin
        assert out.text == real.tokenizer.decode(list(out.token_ids), skip_special_tokens=True)
        assert out.stats["fallback_steps"] == 0


def test_a_question_asked_again_drafts_its_earlier_answer_on_the_gguf_target_and_equals_plain(redis_url, real):
    """The embedded GGUF on llama.cpp through the services: the second time a question comes, the
    target drafts the first answer from its history (blocks of many tokens, which llama.cpp rounds
    differently from one-token steps); both answers equal llama.cpp's plain decoding, tie-aware.
    (method plain: what auto runs on llama.cpp on a CPU; here the pinned GPU-like costs would pick
    prompt lookup, which does not draft from the history.)"""
    from target_service.__main__ import build_parser, load_target, tokenizer_dir_of
    from tests.conftest import GPU_LIKE_COST, FixedCosts

    cpp = load_target(build_parser().parse_args(["--backend", "llamacpp"]))
    question, n, keep = "Write a haiku about the sea.", 48, []

    async def scenario():
        async with local_stack(redis_url, cpp.lm, None, tokenizer_dir=tokenizer_dir_of(cpp, keep),
                               target_costs=FixedCosts(GPU_LIKE_COST)) as st:  # (drafts pay: not this host's costs)
            return [await st.client.generate(st.client.request(chat=[("user", question)], max_tokens=n, method="plain"))
                    for _ in range(2)]

    first, again = run(scenario(), timeout=300)
    prompt = format_prompt(real.tokenizer, question)
    want = plain_generate(cpp.lm, [prompt], stop=StopConditions(max_new_tokens=n, eos_token_ids=cpp.lm.eos_token_ids))[0]
    for out in (first, again):
        assert_greedy_equal(cpp.lm, prompt, out.token_ids, want.token_ids, 0.05)  # llama.cpp's tie margin
    assert first.stats["drafted"] == 0 and again.stats["accepted"] > 0
    assert again.stats["target_forwards"] < first.stats["target_forwards"]
