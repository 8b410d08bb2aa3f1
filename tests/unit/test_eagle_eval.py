"""Comparing EAGLE drafts on prompts (specdec.training.eagle_eval): chains counted by hand, and a
trained draft scores above an untrained one on what it was trained on."""

import pytest
import torch

from specdec.decode import plain_generate
from specdec.eagle import build_eagle, load_eagle
from specdec.training.eagle_eval import accepted_lengths, compare
from specdec.types import StopConditions
from tests.unit.test_eagle import _answers, data_dir, trained_dir  # noqa: F401 (fixtures)


def test_a_chain_counts_its_tokens_up_to_the_first_wrong_one():
    # step s right at position p + s; chains from p = 0..4
    hits = torch.tensor([[1, 1, 0, 1, 1],    # depth 1 right from p = 0, 1, 3, 4
                         [0, 1, 1, 0, 1],    # depth 2 (at p + 1) right from p = 0, 1, 3
                         [0, 0, 1, 1, 0]], dtype=torch.bool)  # depth 3 (at p + 2) right from p = 0, 1
    judged = torch.tensor([True, True, True, True, False])
    right, n = accepted_lengths(hits, judged)
    assert n == 4
    assert right == [3, 3, 2]  # p = 0, 1, 3 | 0, 1, 3 | 0, 1


def test_a_trained_draft_scores_above_an_untrained_one(tiny_target, trained_dir):  # noqa: F811
    prompts = [("synthetic", r["prompt_ids"]) for r in _answers(tiny_target, 4, seed=0)]
    drafts = {"trained": load_eagle(trained_dir, tiny_target), "untrained": build_eagle(tiny_target, torch.arange(64))}
    table = compare(tiny_target, drafts, prompts, max_new_tokens=16, k=3)
    trained, untrained = table["trained"]["all"], table["untrained"]["all"]
    stop = StopConditions(max_new_tokens=16, eos_token_ids=tiny_target.eos_token_ids)
    answers = plain_generate(tiny_target, [p for _, p in prompts], stop=stop)
    assert trained["chains"] == untrained["chains"] == sum(len(a.token_ids) - 1 for a in answers)  # tokens 2..
    assert trained["alpha"] > untrained["alpha"] + 0.1 and trained["accepted"] > untrained["accepted"]
    assert trained["accepted"] >= trained["alpha"]  # a chain accepts its first token at least
    assert set(table["trained"]) == {"synthetic", "all"}


def test_a_tree_accepts_its_longest_path_the_target_agrees_with():
    from specdec.eagle_tree import DraftTree
    from specdec.training.eagle_eval import tree_accepted

    #         0   1   2   3   4   5
    tree = DraftTree(token_ids=(7, 8, 3, 9, 4, 5), parents=(-1, -1, 0, 1, 1, 4), depths=(1, 1, 2, 2, 2, 3))
    assert tree_accepted(tree, [8, 4, 5, 6]) == 3  # 8 -> 4 -> 5, not the first branch
    assert tree_accepted(tree, [7, 9]) == 1  # 9 hangs under 8, not 7
    assert tree_accepted(tree, [1]) == 0 and tree_accepted(tree, []) == 0


def test_a_chain_shaped_tree_accepts_what_the_chain_does_and_a_wider_tree_more(tiny_target, trained_dir):  # noqa: F811
    """tau of a k-node, k-deep tree is 1 + the k-chain's mean accepted tokens (the same positions
    judged; drafting's float16 weights against the chain figures' float32: equal up to rounding),
    and a wider tree of the same depth accepts at least as much."""
    from specdec.training.eagle_eval import TreeShape

    prompts = [("synthetic", r["prompt_ids"]) for r in _answers(tiny_target, 4, seed=1)]
    drafts = {"trained": load_eagle(trained_dir, tiny_target)}
    chain = compare(tiny_target, drafts, prompts, max_new_tokens=16, k=3, tree=TreeShape(3, 3, 1))["trained"]["all"]
    wide = compare(tiny_target, drafts, prompts, max_new_tokens=16, k=3, tree=TreeShape(3, 12, 4))["trained"]["all"]
    assert chain["tree_tau"] == pytest.approx(1 + chain["accepted"], abs=0.03)
    assert wide["tree_tau"] > chain["tree_tau"]


def test_a_context_vocab_draft_s_chains_count_what_its_drafting_drafts(tiny_target):
    """The chain figures mask the context's tokens as drafting does (each chain's committed
    context only): with a subset that holds none of the prompts' or answers' tokens, every
    accepted token is the context's, and a chain-shaped tree, drafted through
    EagleDraft.context_tokens, accepts what the chain figures count."""
    from specdec.training.eagle_eval import TreeShape

    rows = _answers(tiny_target, 4, seed=0, max_new=16)  # answers that repeat their own tokens
    used = {t for r in rows for t in r["prompt_ids"] + r["answer_ids"]}
    free = torch.tensor([t for t in range(96) if t not in used][:2])
    prompts = [("synthetic", r["prompt_ids"]) for r in rows]
    accepted = 0.0
    for seed in range(6):  # untrained drafts: right by chance, each its own way
        torch.manual_seed(seed)
        draft = build_eagle(tiny_target, free, context_vocab=True)
        got = compare(tiny_target, {"context": draft}, prompts, max_new_tokens=16, k=3, tree=TreeShape(3, 3, 1))
        got = got["context"]["all"]
        assert got["tree_tau"] == pytest.approx(1 + got["accepted"], abs=0.03)
        accepted += got["accepted"]
    assert accepted > 0  # (the subset's tokens are never right: only the context's can be)


@pytest.mark.parametrize("subset", [torch.arange(96), torch.arange(0, 96, 2)])
def test_a_copy_token_draft_s_chains_count_what_its_trees_draft_from_each_context_s_candidates(tiny_target, subset):
    """The chain figures (training's batches: every pair's candidate from the true tokens) and a
    chain-shaped tree drafted as decoding drafts it (CopyIndex over the committed tokens and the
    path) count the same, for drafts whose candidates weigh most in what they draft, inside the
    subset or outside it (drafted beside it)."""
    from tests.unit.test_eagle import loud_copy_draft
    from specdec.training.eagle_eval import TreeShape

    prompts = [("synthetic", r["prompt_ids"]) for r in _answers(tiny_target, 4, seed=0, max_new=16)]
    draft = loud_copy_draft(tiny_target, subset)
    got = compare(tiny_target, {"d": draft}, prompts, max_new_tokens=16, k=3, tree=TreeShape(3, 3, 1))["d"]["all"]
    assert got["alpha"] > 0.3  # (an untrained draft without them: 0)
    assert got["tree_tau"] == pytest.approx(1 + got["accepted"], abs=0.03)


@pytest.mark.parametrize("bad", ["4,32", "4,2,8", "0,4,1", "a,b,c"])
def test_a_tree_shape_it_cannot_draft_is_refused_with_what_it_wants(bad, capsys):
    from specdec.training.eagle_eval import main

    with pytest.raises(SystemExit) as exc:
        main(["--tree", bad])
    assert exc.value.code == 2 and "--tree" in capsys.readouterr().err
