"""A target service on llama.cpp (a tiny GGUF written by the test): concurrent sessions through
draft, target and coordinator give exactly this backend's plain greedy output, with the torch
draft and with the target-side fallback (plain: llama.cpp runs no tree methods)."""

from __future__ import annotations

import asyncio

import pytest

from specdec.errors import InvalidRequest
from tests.conftest import assert_greedy_equal, gguf_copy, plain
from tests.services.stack import local_stack, mean_batch_size, run

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


def test_the_draft_service_refuses_llamacpp_with_what_to_do_instead():
    from draft_service.models import load_draft
    from specdec.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="runs its draft on torch"):
        load_draft(None, backend="llamacpp")


def test_sessions_verified_together_on_two_threads_run_side_by_side_and_stay_exact(redis_url, gguf_target, good_draft):
    """With t threads, up to t sessions' steps run at once, each on its own context (run_each)."""
    from specdec.backends.llamacpp import LlamaCppLM

    two = LlamaCppLM(gguf_target.path, threads=2, context=512)
    seen = []
    run_each = two.run_each
    two.run_each = lambda jobs, caches: (seen.append((len(jobs), [c.threads for c in caches])), run_each(jobs, caches))[1]

    async def scenario():
        async with local_stack(redis_url, two, good_draft) as st:
            return await asyncio.gather(*(st.client.generate(st.client.request(token_ids=p, max_tokens=30,
                                                                                method="draft")) for p in PROMPTS))

    outs = run(scenario())
    for p, out in zip(PROMPTS, outs):
        assert_greedy_equal(gguf_target, p, out.token_ids, plain(gguf_target, p, 30).token_ids)
    assert any(n > 1 and threads == [1] * n for n, threads in seen), seen  # side by side, a thread each


def test_a_gguf_target_ships_its_tokenizer_to_the_coordinator(tmp_path):
    """A GGUF file is not a directory of tokenizer files: the target service writes out the
    tokenizer it loaded for it, and serves those files (Info) like a model directory's."""
    from transformers import AutoTokenizer

    from specdec.models import LoadedModel
    from target_service.__main__ import tokenizer_dir_of
    from target_service.core import TargetCore
    from tests.services.stack import save_char_tokenizer

    tok = AutoTokenizer.from_pretrained(save_char_tokenizer(tmp_path / "tok"))
    keep: list = []
    directory = tokenizer_dir_of(LoadedModel(lm=None, tokenizer=tok, path=str(tmp_path / "model.gguf")), keep)
    files = TargetCore.__new__(TargetCore)
    files.tokenizer_dir = directory
    shipped = files.tokenizer_files()
    assert "tokenizer.json" in shipped and "tokenizer_config.json" in shipped
    out = tmp_path / "coordinator-side"
    out.mkdir()
    for name, data in shipped.items():
        (out / name).write_bytes(data)
    again = AutoTokenizer.from_pretrained(out)
    chat = [{"role": "user", "content": "Name a colour."}]
    assert again.apply_chat_template(chat, add_generation_prompt=True) == tok.apply_chat_template(
        chat, add_generation_prompt=True)
    keep[0].cleanup()
    assert tokenizer_dir_of(LoadedModel(lm=None, tokenizer=None, path=str(tmp_path / "model.gguf")), []) is None
