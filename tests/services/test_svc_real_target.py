"""Through the services on the real embedded target (SmolLM2-135M-Instruct): a chat prompt sent
as text (tokenized by the coordinator with the tokenizer the target serves) and a token-id
prompt give exactly plain decoding's tokens and text."""

from __future__ import annotations

import asyncio

import pytest

from specdec.decode import plain_generate
from specdec.models import early_exit_copy, format_prompt, load_model
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
    draft = early_exit_copy(real.lm, 4)

    async def scenario():
        async with local_stack(redis_url, real.lm, draft, methods={}) as st:
            # The stack's target serves no tokenizer; point it at the model directory like `python -m` does.
            st.targets[0].core.tokenizer_dir = real.path
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
