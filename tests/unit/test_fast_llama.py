"""The fast Llama backend: same logits as the transformers path, same cache API, same outputs."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.decode import plain_generate, speculative_generate
from specdec.errors import ModelLoadError
from specdec.backends.fast import FastKVCache, FastLlamaLM, supports_fast
from specdec.backends.fast import KernelChoice, linear_rows
from specdec.backends.hf import CausalLM
from specdec.proposers import DraftModelProposer, PromptLookupProposer
from specdec.tree import block_mask, depths
from specdec.types import StopConditions
from tests.conftest import assert_greedy_equal

ATOL = 1e-5


@pytest.fixture(scope="module")
def pair(tiny_target):
    """(transformers path, fast path) over the same weights."""
    ref = CausalLM(copy.deepcopy(tiny_target.model), name="ref")
    return ref, FastLlamaLM(copy.deepcopy(tiny_target.model), name="fast")


def _both(pair, batch):
    ref, fast = pair
    return ref.new_cache(batch), fast.new_cache(batch)


def test_prefill_logits_and_hidden_match_transformers(pair):
    ref, fast = pair
    prompts = [[3, 4, 5, 6, 7], [8, 9]]
    a = ref.prefill(ref.new_cache(2), prompts, want_hidden=True)
    b = fast.prefill(fast.new_cache(2), prompts, want_hidden=True)
    torch.testing.assert_close(b.logits, a.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(b.hidden, a.hidden, atol=ATOL, rtol=0)


@pytest.mark.parametrize("q", [1, 2, 3, 5, 9])
def test_chain_block_logits_match_transformers_for_every_block_size(pair, q):
    ref, fast = pair
    ca, cb = _both(pair, 1)
    ref.prefill(ca, [[1, 2, 3, 4, 5, 6]])
    fast.prefill(cb, [[1, 2, 3, 4, 5, 6]])
    ids = torch.arange(10, 10 + q)[None]
    torch.testing.assert_close(fast.forward(cb, ids).logits, ref.forward(ca, ids).logits, atol=ATOL, rtol=0)


def test_tree_block_with_padding_matches_transformers(pair):
    ref, fast = pair
    ca, cb = _both(pair, 2)
    ref.prefill(ca, [[1, 2, 3], [4, 5, 6, 7]])
    fast.prefill(cb, [[1, 2, 3], [4, 5, 6, 7]])
    parents = (-1, -1, 0, 0)  # root -> {a, b}; a -> {c, d}
    mask = torch.zeros(2, 5, 5, dtype=torch.bool)
    mask[:] = block_mask(parents)
    depth = depths(parents).expand(2, 5)
    valid = torch.tensor([[True] * 5, [True, True, True, False, False]])
    ids = torch.tensor([[11, 12, 13, 14, 15], [21, 22, 23, 0, 0]])
    a = ref.forward(ca, ids, mask, depth, valid)
    b = fast.forward(cb, ids, mask, depth, valid)
    torch.testing.assert_close(b.logits[0], a.logits[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(b.logits[1, :3], a.logits[1, :3], atol=ATOL, rtol=0)


def test_rollback_select_rows_and_compact_keep_logits_equal_to_transformers(pair):
    ref, fast = pair
    ca, cb = _both(pair, 3)
    for lm, c in ((ref, ca), (fast, cb)):
        lm.prefill(c, [[1, 2, 3, 4], [5, 6], [7, 8, 9]])
        lm.forward(c, torch.tensor([[10, 11, 12]] * 3))
        c.keep_last(torch.tensor([[True, False, False], [True, True, False], [False, False, False]]))
        c.select_rows(torch.tensor([0, 2]))
        c.truncate(torch.tensor([4, 2]))
        c.compact()
    assert torch.equal(cb.valid, ca.valid) and torch.equal(cb.lengths, ca.lengths)
    ids = torch.tensor([[30, 31], [32, 33]])
    torch.testing.assert_close(fast.forward(cb, ids).logits, ref.forward(ca, ids).logits, atol=ATOL, rtol=0)


def test_cache_grows_past_its_initial_capacity(pair):
    ref, fast = pair
    cb = fast.new_cache(1)
    start = cb.hf.capacity
    ids = torch.randint(2, 96, (1, start + 5), generator=torch.Generator().manual_seed(0))
    ca = ref.new_cache(1)
    ref.prefill(ca, [ids[0].tolist()])
    fast.prefill(cb, [ids[0].tolist()])
    assert cb.hf.capacity > start and cb.num_slots == start + 5
    nxt = torch.tensor([[7]])
    torch.testing.assert_close(fast.forward(cb, nxt).logits, ref.forward(ca, nxt).logits, atol=ATOL, rtol=0)


def test_a_cache_grown_inside_a_forward_compacts_outside_one(pair):
    """Growing the store inside a forward makes its tensors inference tensors; a verify step that
    leaves more holes than tokens (a wide tree rejected: tidied by keep_last, outside inference
    mode) then compacts them in place. That crashed once (64-node EAGLE trees on a long prompt)."""
    ref, fast = pair
    gen = torch.Generator().manual_seed(1)
    ca, cb = ref.new_cache(1), fast.new_cache(1)
    prompt = torch.randint(2, 96, (1, cb.hf.capacity + 5), generator=gen)[0].tolist()
    block = torch.randint(2, 96, (1, 300), generator=gen)
    keep = torch.zeros(1, 300, dtype=torch.bool)
    keep[0, 0] = keep[0, -1] = True  # holes in the middle: not cropped as a tail
    for lm, c in ((ref, ca), (fast, cb)):
        lm.prefill(c, [prompt])
        lm.forward(c, block)
        c.keep_last(keep)  # outside inference mode, as verify_step calls it
    assert cb.num_slots == int(cb.lengths[0]) == len(prompt) + 2  # compacted
    nxt = torch.tensor([[7]])
    torch.testing.assert_close(fast.forward(cb, nxt).logits, ref.forward(ca, nxt).logits, atol=ATOL, rtol=0)


def test_new_cache_is_a_fast_cache_with_the_kv_cache_api(pair):
    cache = pair[1].new_cache(2)
    assert isinstance(cache, FastKVCache)
    for name in ("valid", "lengths", "num_slots", "appended", "keep_last", "truncate", "select_rows", "compact"):
        assert hasattr(cache, name)


def test_plain_decoding_equals_the_transformers_path(pair):
    ref, fast = pair
    stop = StopConditions(max_new_tokens=24)
    prompts = [[3, 4, 5], [9, 8, 7, 6]]
    want = plain_generate(ref, prompts, stop=stop)
    got = plain_generate(fast, prompts, stop=stop)
    for p, g, w in zip(prompts, got, want):
        assert_greedy_equal(ref, p, g.token_ids, w.token_ids)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_speculative_on_the_fast_target_equals_its_plain_decoding(pair, tiny_draft, k):
    _, fast = pair
    stop = StopConditions(max_new_tokens=24)
    prompts = [[3, 4, 5, 3, 4], [9, 8, 7]]
    want = plain_generate(fast, prompts, stop=stop)
    got = speculative_generate(fast, DraftModelProposer(tiny_draft), prompts, stop=stop, k=k)
    for p, g, w in zip(prompts, got, want):
        assert_greedy_equal(fast, p, g.token_ids, w.token_ids)
    assert sum(g.stats.accepted for g in got) > 0


def test_a_fast_draft_works_with_a_transformers_target(tiny_target, tiny_draft):
    fast_draft = FastLlamaLM(copy.deepcopy(tiny_draft.model))
    stop = StopConditions(max_new_tokens=16)
    want = plain_generate(tiny_target, [[5, 6, 7]], stop=stop)[0]
    got = speculative_generate(tiny_target, DraftModelProposer(fast_draft), [[5, 6, 7]], stop=stop, k=3)[0]
    assert_greedy_equal(tiny_target, [5, 6, 7], got.token_ids, want.token_ids)


def test_prompt_lookup_on_the_fast_target_equals_its_plain_decoding(pair):
    _, fast = pair
    stop = StopConditions(max_new_tokens=20)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    want = plain_generate(fast, [prompt], stop=stop)[0]
    got = speculative_generate(fast, PromptLookupProposer(), [prompt], stop=stop, k=4)[0]
    assert_greedy_equal(fast, prompt, got.token_ids, want.token_ids)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 12])
@pytest.mark.parametrize("kernel", ["auto", "nt", "linear"])
def test_linear_kernels_agree_with_f_linear(rows, kernel):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, 40, generator=gen)
    w = torch.randn(24, 40, generator=gen)
    torch.testing.assert_close(linear_rows(x, w, kernel), torch.nn.functional.linear(x, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("nt_wins", [True, False])
def test_kernel_choice_takes_the_path_this_host_times_faster_once_per_shape(nt_wins):
    """The W @ x.T vs F.linear choice is the host's, not the machine's it was written on (on an
    Intel Xeon with AMX the EPYC's fixed choice halved plain decoding's speed)."""
    timed = []

    def seconds(call, repeats):
        assert call().shape[1] == 24  # the product itself runs
        is_nt = len(timed) % 2 == 0  # per shape, the W @ x.T path is timed first
        timed.append(is_nt)
        return 1.0 if is_nt == nt_wins else 2.0

    choice = KernelChoice(seconds=seconds)
    w = torch.randn(24, 40)
    assert choice.use_nt(3, w) is nt_wins
    assert choice.use_nt(3, w) is nt_wins and len(timed) == 2  # timed once per shape
    choice.use_nt(4, w)
    assert len(timed) == 4  # another row count is timed anew


def test_a_model_times_its_kernel_choices_at_load_not_in_its_first_request(tiny_target, monkeypatch):
    from specdec.backends import fast

    timed = []

    def seconds(call, repeats):
        timed.append(tuple(call().shape))
        return 1.0

    monkeypatch.setattr(fast, "_KERNELS", KernelChoice(seconds=seconds))
    model = FastLlamaLM(copy.deepcopy(tiny_target.model))
    vocab = model.lm_head.shape[0]
    assert {(m, vocab) for m in range(1, 9)} <= set(timed)  # the output layer, every row count up to 8
    at_load = len(timed)
    cache = model.new_cache(1)
    model.forward(cache, torch.tensor([[3, 4, 5]]))
    for rows in range(1, 9):  # decoding steps and verified blocks of 1-8 tokens
        model.forward(cache, torch.arange(3, 3 + rows)[None])
    assert len(timed) == at_load


def test_reduced_precision_weights_stay_close(tiny_target):
    fast = FastLlamaLM(copy.deepcopy(tiny_target.model), weight_dtype=torch.bfloat16)
    ref = tiny_target
    ids = torch.tensor([[3, 4, 5, 6]])
    a = ref.forward(ref.new_cache(1), ids).logits
    b = fast.forward(fast.new_cache(1), ids).logits
    assert b.dtype == a.dtype
    assert float((a - b).abs().max()) < 0.1 * float(a.abs().max())


def test_transformers_module_still_runs_on_the_fused_weights(tiny_target):
    model = copy.deepcopy(tiny_target.model)
    before = CausalLM(copy.deepcopy(model)).forward(CausalLM(model).new_cache(1), torch.tensor([[3, 4]])).logits
    FastLlamaLM(model)
    after = CausalLM(model).forward(CausalLM(model).new_cache(1), torch.tensor([[3, 4]])).logits
    torch.testing.assert_close(after, before, atol=0, rtol=0)


def test_refuses_a_model_it_cannot_run_with_a_clear_error():
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, attention_bias=True)
    assert "bias" in supports_fast(config)
    with pytest.raises(ModelLoadError, match="backend='hf'"):
        FastLlamaLM(LlamaForCausalLM(config))


def test_refuses_a_cache_from_another_backend(pair, tiny_target):
    with pytest.raises(TypeError, match="new_cache"):
        pair[1].forward(tiny_target.new_cache(1), torch.tensor([[1]]))


def test_fused_rms_norm_equals_transformers_rms_norm_bitwise():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from specdec.backends.fast import _rms_norm

    norm = LlamaRMSNorm(576, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=torch.Generator().manual_seed(0)))
        x = torch.randn(64, 3, 576, generator=torch.Generator().manual_seed(1)) * 3
        assert torch.equal(_rms_norm(x, norm.weight, 1e-5), norm(x))


def test_engine_and_load_model_select_the_backend(tiny_target, tmp_path):
    from specdec.engine import Engine, EngineConfig
    from specdec.models import load_model

    copy.deepcopy(tiny_target.model).save_pretrained(tmp_path)
    assert isinstance(Engine(EngineConfig(target=str(tmp_path), backend="fast")).target.lm, FastLlamaLM)
    assert type(load_model(str(tmp_path)).lm) is CausalLM
    with pytest.raises(ModelLoadError, match="backend"):
        load_model(str(tmp_path), backend="turbo")


def test_auto_backend_picks_fast_for_a_float32_llama_on_cpu_and_hf_otherwise(tiny_target):
    from specdec.models import resolve_backend

    assert resolve_backend(tiny_target.model, "auto") == "fast"
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, attention_bias=True)
    assert resolve_backend(LlamaForCausalLM(config), "auto") == "hf"
    assert resolve_backend(tiny_target.model, "hf") == "hf"
