"""The embedded target's own GGUF (Q4_1) on llama.cpp: every method's greedy output equals this
backend's plain greedy output token for token (lossless relative to the backend that runs the
target), batched and one at a time, with the shipped draft sharing the GGUF's embeddings. Exactly,
with no tolerance for near-ties: a token's logits do not depend on how many tokens its forward
holds (specdec.backends.llamacpp.model.WIDTH_INVARIANT_ENV), which the first test checks."""

import pytest

from specdec.engine import Engine, EngineConfig
from specdec.errors import InvalidRequest
from specdec.types import StopConditions

from tests.integration.conftest import dev_prompts

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(backend="llamacpp"))


@pytest.fixture(scope="module")
def cpp_prompts(engine):
    return dev_prompts(engine.target.tokenizer, ("code", "summarization", "chat"))


@pytest.fixture(scope="module")
def cpp_plain(engine, cpp_prompts):
    stop = StopConditions(max_new_tokens=32)
    return [engine.generate_ids([p], "plain", stop=stop)[0] for p in cpp_prompts]


def test_a_tokens_logits_do_not_depend_on_how_many_tokens_its_forward_holds(engine):
    """A chain fed in one forward of 2 to 64 tokens gives every token the logits of one-token
    steps, bit for bit, past 512 KV cells (where llama.cpp's flash attention split a one-token
    forward's attention across the threads) and across a 256-cell padding boundary. With flash
    attention and llamafile's tinyBLAS, 2 tokens against 1 differed by 0.65 in the logits here, and
    a greedy EAGLE run parted from plain decoding on the dev set's rag prompt at its 36th token."""
    import torch

    from specdec.models import format_prompt
    from specdec.prompt_sets import first_per_category, read_prompt_rows

    lm, tokenizer = engine.target.lm, engine.target.tokenizer
    document = format_prompt(tokenizer, first_per_category(read_prompt_rows(), ("rag",))[0]["turns"][0])
    tokens = (document * 2)[:760 + 64]  # fed from cell 760: the 64-token forward runs past cell 768
    assert len(document) > 512
    start = 760

    def fed(width: int) -> torch.Tensor:
        kv = lm.new_cache(1)
        lm.prefill(kv, [tokens[:start]])
        blocks = [lm.forward(kv, torch.tensor([tokens[i:i + width]])).logits[0]
                  for i in range(start, len(tokens), width)]
        return torch.cat(blocks)

    steps = fed(1)
    for width in (2, 3, 5, 9, 16, 64):
        got = fed(width)
        assert torch.equal(got, steps), f"width {width}: {float((got - steps).abs().max()):.3g} from one-token steps"


def test_eagle_on_llamacpp_equals_plain_on_the_prompt_where_it_parted(engine):
    """A rag prompt of the dev set (a 693-token document), 64 greedy tokens: EAGLE chains of 1 and 4
    give plain decoding's tokens. Before the width-invariant set-up both took token 28 where plain
    decoding took 281 (logits 0.014 apart) at generated token 35."""
    from specdec.models import format_prompt
    from specdec.prompt_sets import read_prompt_rows

    [row] = [r for r in read_prompt_rows() if r["id"] == "spec_bench-484"]
    prompt = format_prompt(engine.target.tokenizer, row["turns"][0])
    stop = StopConditions(max_new_tokens=64)
    want = engine.generate_ids([prompt], "plain", stop=stop)[0].token_ids
    chains = Engine.from_models(engine.target, config=EngineConfig(backend="llamacpp", eagle_depth="k"),
                                costs=engine.costs)
    for k in (1, 4):
        got = chains.generate_ids([prompt], "eagle", stop=stop, k=k)[0]
        assert list(got.token_ids) == list(want), f"k={k}"
        assert got.stats.accepted > 0, "nothing was accepted: the test checks nothing"


SHORT_ANSWERS = ("What is 2 + 2? Answer with the number only.", "Hi!", "Name a color.",
                 "Is the sky blue on a clear day? Answer yes or no.")


def test_the_gguf_target_stops_where_the_converted_model_stops(engine, real):
    """On prompts the model answers in a few tokens, the GGUF on llama.cpp and its float32 copy on
    torch both end their answer with an end-of-turn token, at the same place where they agree on
    the answer (Q4_1 and float32 may word it differently: then each must still stop)."""
    from specdec.decode import plain_generate
    from specdec.models import format_prompt

    assert set(real.lm.eos_token_ids) <= set(engine.target.lm.eos_token_ids)
    assert engine.target.lm.vocab_size == real.lm.vocab_size
    for question in SHORT_ANSWERS:
        prompt = format_prompt(real.tokenizer, question)
        cpp = engine.generate_ids([prompt], "plain", stop=StopConditions(max_new_tokens=48))[0]
        f32 = plain_generate(real.lm, [prompt], stop=StopConditions(max_new_tokens=48,
                                                                      eos_token_ids=real.lm.eos_token_ids))[0]
        for out in (cpp, f32):
            assert out.finish_reason == "stop" and out.token_ids[-1] in real.lm.eos_token_ids, \
                f"{question!r}: {real.tokenizer.decode(out.token_ids)!r} did not end its turn"
        if cpp.token_ids[:-1] == f32.token_ids[:-1]:
            assert cpp.token_ids == f32.token_ids


@pytest.mark.parametrize("method,k", [("prompt-lookup", 4), ("prompt-lookup", "auto"), ("draft", 3), ("draft", "auto")])
def test_every_method_on_llamacpp_equals_its_plain_decoding(engine, cpp_prompts, cpp_plain, method, k):
    stop = StopConditions(max_new_tokens=32)
    got = engine.generate_ids(cpp_prompts, method, stop=stop, k=k)  # the three prompts batched
    for p, g, w in zip(cpp_prompts, got, cpp_plain):
        assert list(g.token_ids) == list(w.token_ids)
    if k != "auto":
        assert sum(g.stats.accepted for g in got) > 0, "nothing was accepted: rollback paths were not exercised"


def test_lookahead_on_llamacpp_is_refused_with_a_clear_message(engine, cpp_prompts):
    with pytest.raises(InvalidRequest, match="method lookahead verifies tree blocks.*use backend fast or hf"):
        engine.generate_ids(cpp_prompts[:1], "lookahead", stop=StopConditions(max_new_tokens=8))


def test_the_shipped_medusa_heads_run_on_llamacpp_as_a_chain_and_equal_its_plain(engine, cpp_prompts, cpp_plain):
    """The heads read the final hidden state llama.cpp returns with the logits; the GGUF's output
    layer is the one they were trained on (same fingerprint)."""
    stop = StopConditions(max_new_tokens=32)
    got = engine.generate_ids(cpp_prompts, "medusa", stop=stop, k=4)
    for p, g, w in zip(cpp_prompts, got, cpp_plain):
        assert list(g.token_ids) == list(w.token_ids)
    proposer = engine.proposer_factory("medusa")()
    assert all(set(path) == {0} for path in proposer.tree.paths)  # a chain (or no draft at all: plain steps)
    chain = Engine.from_models(engine.target, config=EngineConfig(backend="llamacpp", medusa_tree="chain"),
                               costs=engine.costs)
    got = chain.generate_ids(cpp_prompts, "medusa", stop=stop, k=4)
    for p, g, w in zip(cpp_prompts, got, cpp_plain):
        assert list(g.token_ids) == list(w.token_ids)
    assert sum(g.stats.accepted for g in got) > 0, "no head candidate accepted: the test checks nothing"


def test_a_prefix_restored_on_the_gguf_gives_a_fresh_prefills_logits_bit_for_bit(engine):
    """A document asked about again reuses all it shares with the first question, a short prompt
    after another one its chat template, and a conversation's next turn the first turn's decoded
    answer: each then gets the very logits of a fresh prefill. (With flash attention on, restoring
    all they share moved them by 0.73 and 0.81 here and changed 4 of 6 served answers, so only whole
    512-token prefill blocks were reused.)"""
    import torch

    from specdec.models import format_prompt
    from specdec.prefix_cache import PrefixCache, remember, restore_longest
    from specdec.prompt_sets import first_per_category, read_prompt_rows
    from specdec.verify import common_prefix_len

    lm, tokenizer = engine.target.lm, engine.target.tokenizer
    document = first_per_category(read_prompt_rows(), ("rag",))[0]["turns"][0]
    asked, again = (format_prompt(tokenizer, f"{document}\n\n{q}") for q in ("Summarize this.", "Who is it about?"))
    hi = format_prompt(tokenizer, "Hi!")
    answer = engine.generate_ids([hi], "plain", stop=StopConditions(max_new_tokens=24))[0].token_ids
    turn = [*hi, *answer, *format_prompt(tokenizer, "And then?")[1:]]
    cache = PrefixCache(256 << 20)
    for seen in (hi, asked):  # what the server read before
        kv = lm.new_cache(1)
        lm.prefill(kv, [seen])
        remember(cache, lm, kv, seen)
    kv = lm.new_cache(1)  # the first turn as decoded: prompt prefilled, answer in one-token steps
    lm.prefill(kv, [hi])
    for token in answer[:-1]:
        lm.greedy_step(kv, token)
    remember(cache, lm, kv, [*hi, *answer[:-1]])
    color = format_prompt(tokenizer, "Name a color.")
    for prompt, shared in ((again, asked), (color, hi), (turn, [*hi, *answer[:-1]])):
        fresh = lm.prefill(lm.new_cache(1), [prompt]).logits[0].clone()
        n, kv = restore_longest(cache, lm, prompt, at_most=len(prompt) - 1)
        common = common_prefix_len(prompt, shared)
        assert common - cache.block < n <= common, (n, common)
        logits = lm.prefill(kv, [prompt[n:]]).logits[0]
        assert torch.equal(logits, fresh), float((logits - fresh).abs().max())


def test_decoding_on_two_threads_is_decoding_on_one_thread_token_for_token(engine, real):
    """A matmul's output elements are each one vec_dot, whichever thread computes them, and without
    flash attention a one-token forward's attention is no longer split across the threads (a
    reduction whose order followed the thread count: one-token steps on 2 threads then parted from
    1 thread by up to 0.58 in the logits, and plain decoding on 2 threads from plain on 1 in 4 of 40
    dev prompts within 64 tokens, this one at its third token). Plain decoding and speculative
    decoding on 2 threads both give plain decoding's output on 1 thread."""
    from specdec.backends.llamacpp import LlamaCppLM
    from specdec.decode import plain_generate, speculative_generate
    from specdec.models import early_exit_copy, format_prompt
    from specdec.prompt_sets import read_prompt_rows
    from specdec.proposers import DraftModelProposer

    path = engine.target.lm.path
    [row] = [r for r in read_prompt_rows() if r["id"] == "mt_bench-136"]
    prompt = format_prompt(engine.target.tokenizer, row["turns"][0])
    stop = StopConditions(max_new_tokens=32)
    one = LlamaCppLM(path, threads=1)
    want = plain_generate(one, [prompt], stop=stop)[0].token_ids
    del one
    two = LlamaCppLM(path, threads=2)
    assert list(plain_generate(two, [prompt], stop=stop)[0].token_ids) == list(want)
    got = speculative_generate(two, DraftModelProposer(early_exit_copy(real.lm, 2)), [prompt], stop=stop, k=3)[0]
    assert list(got.token_ids) == list(want)
    assert got.stats.accepted > 0, "nothing was accepted: the test checks nothing"
