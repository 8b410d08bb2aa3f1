"""Draft distillation on a tiny target: it learns, checkpoints, resumes, and the draft it writes
loads onto the target and keeps speculative decoding lossless."""

import random

import pytest

from specdec.decode import plain_generate, speculative_generate
from specdec.drafts import is_draft_dir, load_draft
from specdec.errors import IncompatibleModels
from specdec.testing import tiny_llama
from specdec.proposers import DraftModelProposer
from specdec.training.draft import DraftRecipe, train_draft
from specdec.training.selfdistill import write_part
from specdec.types import SamplingParams, StopConditions
from tests.conftest import assert_greedy_equal

RECIPE = DraftRecipe(layers=(0,), vocab=48, topk=8, lr=3e-3, warmup_steps=2, tokens_per_step=256, heldout_every=5)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, tiny_target):
    out = tmp_path_factory.mktemp("selfdistill")
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 96) for _ in range(rng.randrange(3, 9))] for _ in range(40)]
    results = plain_generate(tiny_target, prompts, sampling=SamplingParams(temperature=1.0, seed=3),
                             stop=StopConditions(max_new_tokens=24))
    rows = [{"index": i, "category": "synthetic", "sampled": True, "prompt_ids": p, "answer_ids": list(r.token_ids)}
            for i, (p, r) in enumerate(zip(prompts, results))]
    write_part(out, 0, rows[:20])
    write_part(out, 20, rows[20:])
    return out


def test_training_improves_agreement_and_resumes(tiny_target, data_dir, tmp_path):
    out, work = tmp_path / "draft", tmp_path / "work"
    first = train_draft(tiny_target, [data_dir], out, work, recipe=RECIPE, max_steps=1, target_name="tiny")
    assert is_draft_dir(out)
    second = train_draft(tiny_target, [data_dir], out, work, recipe=RECIPE, max_steps=40, resume=True,
                         target_name="tiny")
    assert second.step == 40 and second.tokens_seen > first.tokens_seen  # continued, not restarted
    assert second.history[-1][2] < 0.95 * first.history[-1][2]  # held-out distillation loss fell


def test_trained_draft_is_lossless_and_refuses_other_targets(tiny_target, data_dir, tmp_path):
    out = tmp_path / "draft"
    train_draft(tiny_target, [data_dir], out, tmp_path / "work", recipe=RECIPE, max_steps=5, target_name="tiny")
    draft = load_draft(out, tiny_target, target_name="tiny")
    prompts = [[5, 17, 33, 2], [9, 9, 40, 41, 42]]
    stop = StopConditions(max_new_tokens=20)
    got = speculative_generate(tiny_target, DraftModelProposer(draft), prompts, stop=stop, k=3)
    for p, g in zip(prompts, got):
        assert_greedy_equal(tiny_target, p, g.token_ids, plain_generate(tiny_target, [p], stop=stop)[0].token_ids)
    with pytest.raises(IncompatibleModels, match="trained for target 'tiny'"):
        load_draft(out, tiny_target, target_name="another")
    with pytest.raises(IncompatibleModels, match="vocabulary"):
        load_draft(out, tiny_llama(seed=0, vocab_size=50))


def test_draft_runs_alike_on_both_backends(tiny_target, tmp_path):
    """The fast forward of a subset-head draft scores the same tokens as the transformers one."""
    import torch

    from specdec.backends.subset_head import SubsetHeadLM
    from specdec.drafts import build_from_target, save_draft
    from specdec.backends.fast import FastLlamaLM

    subset = torch.arange(0, 96, 3)
    save_draft(tmp_path / "d", build_from_target(tiny_target, [1, 0]), subset, {"target": "tiny"},
               dtype=torch.float32)
    hf, fast = (load_draft(tmp_path / "d", tiny_target, backend=b) for b in ("hf", "fast"))
    assert isinstance(hf, SubsetHeadLM) and isinstance(fast, FastLlamaLM)
    ids = torch.tensor([[5, 17, 33, 2, 8, 11]])
    outs = []
    for lm in (hf, fast):
        cache = lm.new_cache(1)
        outs.append(torch.cat([lm.forward(cache, ids[:, :4]).logits, lm.forward(cache, ids[:, 4:]).logits], dim=1))
    finite = torch.isfinite(outs[0])
    assert torch.equal(finite, torch.isfinite(outs[1]))
    assert finite[0, 0].nonzero().flatten().tolist() == subset.tolist()  # only the subset is ever drafted
    torch.testing.assert_close(outs[0][finite], outs[1][finite], rtol=1e-4, atol=1e-4)


def test_eval_report_measures_a_draft_per_category(tiny_target, tiny_draft):
    from specdec.training.draft_eval import agreement, evaluate_draft, format_report

    prompts = [("code", [5, 17, 33, 2]), ("chat", [9, 9, 40, 41]), ("chat", [60, 12, 7])]
    reports, costs = evaluate_draft(tiny_target, tiny_draft, prompts, k=3, max_new_tokens=12)
    by_cat = {r.category: r for r in reports}
    assert set(by_cat) == {"code", "chat"} and by_cat["chat"].prompts == 2
    assert all(r.identical and 0.0 <= r.alpha_greedy <= 1.0 and r.tau >= 1.0 for r in reports)
    assert costs["c"] > 0 and costs["v"][1] == 1.0 and set(costs["v"]) == {1, 2, 3, 4}
    text = format_report(reports, costs, 3, history=[[1000, 0.25, 3.0]])
    # alpha is the per-token acceptance rate: a draft identical to the target is always accepted
    answer = list(plain_generate(tiny_target, [[5, 17, 33, 2]], stop=StopConditions(max_new_tokens=12))[0].token_ids)
    hits, accept, n = agreement(tiny_target, tiny_target, [5, 17, 33, 2], answer)
    assert hits == n == 12 and abs(accept - 12) < 1e-3
    hits, accept, n = agreement(tiny_target, tiny_draft, [5, 17, 33, 2], answer)
    assert n == 12 and accept < 12
    assert "| chat | 2 |" in text and "measured, k auto" in text and "1000: 0.250" in text


def test_a_draft_retrained_on_new_data_starts_from_its_own_layers_and_token_subset(tiny_target, data_dir, tmp_path):
    """--init DIR: the run starts from that draft (a draft retrained on other data), not from
    copies of the target's layers and the new data's frequent tokens; a draft of another shape
    is refused."""
    import json

    from safetensors.torch import load_file

    first = tmp_path / "first"
    train_draft(tiny_target, [data_dir], first, tmp_path / "w1", recipe=RECIPE, max_steps=5, target_name="tiny")
    again = tmp_path / "again"
    train_draft(tiny_target, [data_dir], again, tmp_path / "w2", recipe=RECIPE, max_steps=0, target_name="tiny",
                init_from=first)
    ids = [json.loads((d / "draft_vocab.json").read_text())["token_ids"] for d in (first, again)]
    assert ids[0] == ids[1]
    a, b = load_file(str(first / "draft.safetensors")), load_file(str(again / "draft.safetensors"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    fresh = tmp_path / "fresh"
    train_draft(tiny_target, [data_dir], fresh, tmp_path / "w3", recipe=RECIPE, max_steps=0, target_name="tiny")
    c = load_file(str(fresh / "draft.safetensors"))
    assert any(not a[k].equal(c[k]) for k in a), "a fresh run started from the trained draft too"
    with pytest.raises(ValueError, match="layers"):
        train_draft(tiny_target, [data_dir], tmp_path / "x", tmp_path / "w4", max_steps=0, target_name="tiny",
                    recipe=DraftRecipe(layers=(0, 1), vocab=48, topk=8, tokens_per_step=256, heldout_every=5),
                    init_from=first)
