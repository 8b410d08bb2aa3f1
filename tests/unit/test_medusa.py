"""Medusa on the tiny target: heads trained briefly on the target's own greedy answers, then
greedy equality with plain decoding for a chain, a narrow and a wide tree (batch 1 and 3),
KV compaction of the accepted path, lossless sampling along the tree, typical acceptance
wiring, heads save/load and refusal of heads trained for another target."""

import random

import numpy as np
import pytest
import torch

from specdec.decode import plain_generate, speculative_generate
from specdec.errors import IncompatibleModels, InvalidRequest, ModelLoadError
from specdec.medusa_heads import load_heads, new_heads, read_config, save_heads
from specdec.testing import tiny_llama
from specdec.proposers.medusa import MedusaProposer
from specdec.tree import compile_tree
from specdec.training.medusa import Example, MedusaRecipe, train_medusa
from specdec.types import ProposeContext, SamplingParams, StopConditions, TypicalAcceptance
from tests.conftest import FixedCosts, assert_greedy_equal, full_logits, gguf_copy

CHAIN = "chain"
NARROW = [[0], [1], [0, 0], [0, 0, 0]]
WIDE = [[0], [1], [2], [3], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0, 0]]


def _random_prompts(n, seed, vocab=96):
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randrange(3, 9))] for _ in range(n)]


@pytest.fixture(scope="module")
def tiny_heads_dir(tiny_target, tmp_path_factory):
    prompts = _random_prompts(32, seed=0)
    answers = plain_generate(tiny_target, prompts, stop=StopConditions(max_new_tokens=32))
    examples = [Example(tuple(p), r.token_ids) for p, r in zip(prompts, answers)]
    out = tmp_path_factory.mktemp("tiny_heads")
    train_medusa(tiny_target, examples, out, recipe=MedusaRecipe(vocab=0, positions_per_step=256, heldout_every=8),
                 max_steps=120, log=lambda s: None)
    return out


@pytest.fixture(scope="module")
def tiny_heads(tiny_target, tiny_heads_dir):
    return load_heads(tiny_heads_dir, tiny_target)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("tree", [CHAIN, NARROW, WIDE], ids=["chain", "narrow", "wide"])
def test_medusa_greedy_equals_plain(tiny_target, tiny_heads, tree, batch):
    prompts = _random_prompts(3, seed=7)
    stop = StopConditions(max_new_tokens=32)
    want = [r.token_ids for r in plain_generate(tiny_target, prompts, stop=stop)]
    proposer = MedusaProposer(tiny_target, tiny_heads, tree)
    got = []
    for i in range(0, len(prompts), batch):
        got += speculative_generate(tiny_target, proposer, prompts[i : i + batch], stop=stop, k=4)
    for p, g, w in zip(prompts, got, want):
        assert_greedy_equal(tiny_target, p, g.token_ids, w)
    assert sum(g.stats.accepted for g in got) > 0, "no head candidate was ever accepted: the test checks nothing"


def test_trained_heads_beat_chance(tiny_heads_dir):
    acc = read_config(tiny_heads_dir).accuracy
    assert len(acc) == 4 and all(row[0] > 0.1 for row in acc), acc  # chance is ~1/96


def test_a_row_never_drafts_deeper_than_its_k(tiny_target, tiny_heads):
    proposer = MedusaProposer(tiny_target, tiny_heads, WIDE)
    hidden = torch.randn(3, tiny_target.config.hidden_size)
    ctx = ProposeContext(row_ids=(0, 1, 2), token_ids=((5,), (6,), (7,)), k=(0, 1, 4),
                         target_hidden=tuple(hidden))
    props = proposer.propose(ctx)
    assert props[0].token_ids == ()
    assert set(props[1].parents) == {-1} and len(props[1].token_ids) == 4  # the four depth-1 nodes
    assert len(props[2].token_ids) == len(WIDE)


def test_proposal_tokens_follow_the_heads_top_candidates(tiny_target, tiny_heads):
    proposer = MedusaProposer(tiny_target, tiny_heads, NARROW)
    hidden = torch.randn(tiny_target.config.hidden_size)
    [prop] = proposer.propose(ProposeContext(row_ids=(0,), token_ids=((5,),), k=(4,), target_hidden=(hidden,)))
    with torch.inference_mode():
        logits = tiny_heads.logits(hidden, tiny_target.model.get_output_embeddings())  # [K, vocab]
    top = logits.topk(2, dim=-1).indices
    tree = compile_tree(NARROW)  # paths (0,), (1,), (0, 0), (0, 0, 0)
    assert prop.parents == tree.parents
    assert prop.token_ids == (int(top[0, 0]), int(top[0, 1]), int(top[1, 0]), int(top[2, 0]))


def test_accepted_path_kv_is_compacted_into_the_cache(tiny_target, tiny_heads):
    """One verification step by hand: after keeping root + accepted path and squeezing the
    cache, the next forward scores exactly as a fresh run over the committed tokens."""
    from specdec.tree import greedy_walk

    lm = tiny_target
    prompt = _random_prompts(1, seed=3)[0]
    cache = lm.new_cache(1)
    first = lm.prefill(cache, [prompt], want_hidden=True)
    committed = prompt + [int(first.logits[0].argmax())]
    proposer = MedusaProposer(lm, tiny_heads, WIDE)
    hidden = first.hidden[0]
    for _ in range(6):
        [prop] = proposer.propose(ProposeContext(row_ids=(0,), token_ids=(tuple(committed),), k=(4,),
                                                 target_hidden=(hidden,)))
        tree = compile_tree(WIDE)
        ids = torch.tensor([[committed[-1], *prop.token_ids]])
        out = lm.forward(cache, ids, tree.mask[None], tree.depth[None], want_hidden=True)
        path, nxt = greedy_walk(prop.token_ids, prop.parents, out.logits[0].argmax(-1).tolist())
        keep = torch.zeros(1, ids.shape[1], dtype=torch.bool)
        keep[0, 0] = True
        keep[0, [p + 1 for p in path]] = True
        cache.keep_last(keep)
        cache.compact()
        hidden = out.hidden[0, path[-1] + 1 if path else 0]
        committed += [prop.token_ids[p] for p in path] + [nxt]
        assert int(cache.lengths[0]) == len(committed) - 1  # every committed token but the newest
        assert cache.num_slots == len(committed) - 1  # no holes left
    step = lm.forward(cache, torch.tensor([[committed[-1]]])).logits[0, -1]
    assert torch.allclose(step, full_logits(lm, committed)[-1], atol=1e-4)


def test_sampling_along_the_tree_matches_the_target_distribution(tiny_target, tiny_heads):
    """Joint histogram of the first two emitted tokens over many independently seeded rows vs the
    target's own joint probabilities (the second token is decided by the tree step)."""
    from scipy.stats import chisquare

    from specdec.sampling import logits_to_probs

    lm = tiny_target
    prompt = _random_prompts(1, seed=5)[0]
    sampling = SamplingParams(temperature=0.5, top_k=4, seed=3)  # 16 joint outcomes, each likely enough to test
    rows = 1000
    results = speculative_generate(lm, MedusaProposer(lm, tiny_heads, WIDE), [prompt] * rows,
                                   sampling=sampling, stop=StopConditions(max_new_tokens=3), k=4)
    assert sum(r.stats.accepted for r in results) > 0, "no candidate accepted: the tree path was not exercised"
    vocab = lm.vocab_size
    first = logits_to_probs(full_logits(lm, prompt)[-1], sampling).double()
    seen_first = sorted({r.token_ids[0] for r in results})
    probs = np.zeros((vocab, vocab))
    for a in range(vocab):
        if first[a] * rows >= 1 or a in seen_first:
            probs[a] = (first[a] * logits_to_probs(full_logits(lm, prompt + [a])[-1], sampling).double()).numpy()
        else:
            probs[a, 0] = float(first[a])  # rare first tokens: pooled below, their successors do not matter
    probs, counts = probs.flatten(), np.zeros(vocab * vocab)
    for r in results:
        counts[r.token_ids[0] * vocab + r.token_ids[1]] += 1
    keep = probs * rows >= 5
    assert counts[probs == 0].sum() == 0, "emitted a pair the target gives probability 0"
    expected, observed = probs[keep] * rows, counts[keep]
    if probs[~keep].sum() > 0:  # rare outcomes are pooled into one bin
        expected, observed = np.append(expected, probs[~keep].sum() * rows), np.append(observed, counts[~keep].sum())
    assert chisquare(observed, expected / expected.sum() * observed.sum()).pvalue > 0.001


def test_typical_acceptance_runs_and_is_reproducible(tiny_target, tiny_heads):
    sampling = SamplingParams(temperature=0.7, seed=1, typical=TypicalAcceptance(0.09, 0.3))
    prop = MedusaProposer(tiny_target, tiny_heads, WIDE)
    runs = [speculative_generate(tiny_target, prop, [[4, 5, 6]], sampling=sampling,
                                 stop=StopConditions(max_new_tokens=24), k=4)[0] for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids
    assert len(runs[0].token_ids) == 24


def test_typical_acceptance_under_greedy_stays_exact(tiny_target, tiny_heads):
    prompt = [9, 8, 7, 6]
    stop = StopConditions(max_new_tokens=30)
    want = plain_generate(tiny_target, [prompt], stop=stop)[0].token_ids
    sampling = SamplingParams(typical=TypicalAcceptance())
    got = speculative_generate(tiny_target, MedusaProposer(tiny_target, tiny_heads, WIDE), [prompt],
                               sampling=sampling, stop=stop, k=4)[0].token_ids
    assert_greedy_equal(tiny_target, prompt, got, want)


def test_heads_round_trip_through_disk(tiny_target, tiny_heads, tmp_path):
    save_heads(tiny_heads, tmp_path)
    again = load_heads(tmp_path, tiny_target)
    h = torch.randn(2, tiny_target.config.hidden_size)
    with torch.inference_mode():
        # Stored as float16: equal up to that rounding.
        assert torch.allclose(again.states(h), tiny_heads.states(h), atol=1e-2)
    assert read_config(tmp_path).target_fingerprint == tiny_heads.config.target_fingerprint


def test_heads_for_another_target_are_refused(tiny_heads_dir):
    other = tiny_llama(seed=5, vocab_size=96, num_layers=2, hidden_size=48)  # same shapes, other weights
    with pytest.raises(IncompatibleModels, match="fingerprint"):
        load_heads(tiny_heads_dir, other)
    smaller = tiny_llama(seed=0, vocab_size=64, num_layers=2, hidden_size=48)
    with pytest.raises(IncompatibleModels, match="vocab"):
        load_heads(tiny_heads_dir, smaller)


def test_missing_heads_directory_is_a_clear_error(tiny_target, tmp_path):
    with pytest.raises(ModelLoadError, match="missing"):
        load_heads(tmp_path, tiny_target)


@pytest.mark.parametrize("tree, msg", [("[[0, 0]]", "no parent"), ("[[0],[0,0],[0,0,0],[0,0,0,0],[0,0,0,0,0]]", "only 4"),
                                       ("bushy", "unknown tree"), ("[[0],", "not valid JSON")])
def test_bad_trees_are_refused(tiny_target, tiny_heads, tree, msg):
    with pytest.raises(InvalidRequest, match=msg):
        MedusaProposer(tiny_target, tiny_heads, tree)


def test_tree_by_size_uses_the_measured_accuracies(tiny_target, tiny_heads):
    prop = MedusaProposer(tiny_target, tiny_heads, "5")
    assert prop.tree.num_nodes == 5
    untrained = new_heads(tiny_target)
    with pytest.raises(InvalidRequest, match="accuracies"):
        MedusaProposer(tiny_target, untrained, "5")
    assert MedusaProposer(tiny_target, untrained).tree.paths == ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))


def test_eval_counts_head_hits_against_the_greedy_answer(tiny_target, tiny_heads):
    from specdec.training.medusa_eval import head_top1

    prompt = [9, 8, 7, 6]
    answer = list(plain_generate(tiny_target, [prompt], stop=StopConditions(max_new_tokens=16))[0].token_ids)
    hits, counted = head_top1(tiny_target, tiny_heads, prompt, answer)
    assert counted == [len(answer) - 1 - i for i in range(4)]  # head i has a label for all but the last i + 1 rows
    assert all(0 <= h <= c for h, c in zip(hits, counted)) and sum(hits) > 0


@pytest.fixture(scope="module")
def gguf_tiny(tiny_target, tmp_path_factory):
    return gguf_copy(tiny_target, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_the_llamacpp_backend_returns_the_final_hidden_state_with_the_logits(tiny_target, gguf_tiny):
    ids = torch.tensor([_random_prompts(1, seed=3)[0]])
    want = tiny_target.forward(tiny_target.new_cache(1), ids, want_hidden=True).hidden
    got = gguf_tiny.forward(gguf_tiny.new_cache(1), ids, want_hidden=True).hidden
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)
    cache = gguf_tiny.new_cache(2)
    prompts = _random_prompts(2, seed=4)
    out = gguf_tiny.prefill(cache, prompts)
    hidden = gguf_tiny.prefill(gguf_tiny.new_cache(2), prompts, want_hidden=True).hidden  # [2, hidden] at each last token
    for b, p in enumerate(prompts):
        one = tiny_target.forward(tiny_target.new_cache(1), torch.tensor([p]), want_hidden=True).hidden[0, -1]
        torch.testing.assert_close(hidden[b], one, atol=2e-3, rtol=1e-3)
    assert out.hidden is None


@pytest.mark.parametrize("tree", ["chain", "auto"])
def test_medusa_on_llamacpp_runs_a_chain_and_equals_its_plain_decoding(gguf_tiny, tiny_heads_dir, tree):
    heads = load_heads(tiny_heads_dir, gguf_tiny)  # the GGUF's output layer is the target's: accepted
    prompts = _random_prompts(3, seed=7)
    stop = StopConditions(max_new_tokens=32)
    want = [r.token_ids for r in plain_generate(gguf_tiny, prompts, stop=stop)]
    proposer = MedusaProposer(gguf_tiny, heads, tree, costs=FixedCosts({1: 1.0, 2: 1.0, 3: 1.0, 5: 1.0}))
    assert all(len(p) == i + 1 and set(p) == {0} for i, p in enumerate(proposer.tree.paths)) and proposer.tree.paths
    got = speculative_generate(gguf_tiny, proposer, prompts, stop=stop, k=4)
    for p, g, w in zip(prompts, got, want):
        assert_greedy_equal(gguf_tiny, p, g.token_ids, w)
    assert sum(g.stats.accepted for g in got) > 0


def test_a_branching_medusa_tree_on_llamacpp_is_refused_with_what_to_use(gguf_tiny, tiny_heads_dir):
    heads = load_heads(tiny_heads_dir, gguf_tiny)
    with pytest.raises(InvalidRequest, match="causal chains only.*--tree auto or chain"):
        MedusaProposer(gguf_tiny, heads, NARROW)


def test_medusa_on_llamacpp_where_drafting_does_not_pay_reads_no_hidden_state(gguf_tiny, tiny_heads_dir):
    """`--tree auto` with a forward over k tokens costing k single ones picks depth 0: plain steps,
    and no hidden states (llama.cpp computes them at a cost, the target service asks only for a
    proposer that reads them)."""
    heads = load_heads(tiny_heads_dir, gguf_tiny)
    proposer = MedusaProposer(gguf_tiny, heads, "auto", costs=FixedCosts({1: 1.0, 2: 2.0, 3: 3.0, 5: 5.0}))
    assert proposer.tree.max_depth == 0 and proposer.needs_hidden is False
    prompts = _random_prompts(2, seed=3)
    stop = StopConditions(max_new_tokens=12)
    got = speculative_generate(gguf_tiny, proposer, prompts, stop=stop, k=4)
    want = [r.token_ids for r in plain_generate(gguf_tiny, prompts, stop=stop)]
    assert [g.token_ids for g in got] == want and sum(g.stats.drafted for g in got) == 0
