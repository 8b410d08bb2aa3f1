"""EAGLE drafts: greedy output equals plain decoding (untrained and trained drafts, both torch
backends), sampling follows the target's distribution, the loop hands the proposer exactly the
target's features, training learns, checkpoints and resumes, and drafts refuse other targets."""

import copy
import json
import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from specdec.decode import KSchedule, plain_generate, speculative_generate
from specdec.eagle import build_eagle, is_eagle_dir, load_eagle, save_eagle, widen_fc
from specdec.engine import Engine, EngineConfig
from specdec.errors import FailedPrecondition, IncompatibleModels, InvalidRequest, ModelLoadError
from specdec.backends.fast import FastLlamaLM
from specdec.models import LoadedModel
from specdec.testing import perturbed_copy, tiny_llama
from specdec.proposers import DraftModelProposer, EagleProposer, ProposerEnv, load_proposer
from specdec.proposers.eagle import feature_start
from specdec.training.eagle import EagleRecipe, make_batch, train_eagle, unroll_mask, unrolled_outputs
from specdec.training.selfdistill import write_part
from specdec.types import SamplingParams, StopConditions
from tests.conftest import GPU_LIKE_COST, LLAMACPP_CPU_COST, check_greedy, assert_greedy_equal, gguf_copy
from tests.unit.test_sampling_e2e import PROMPT, ROWS, VOCAB, _assert_fits, _histogram, _joint_probs

PROMPTS = [[5, 17, 33, 2, 40], [9, 9], [60, 12, 7, 88, 3, 21, 45, 50, 11]]
RECIPE = EagleRecipe(vocab=64, lr=3e-3, warmup_steps=2, tokens_per_step=256, heldout_every=5)


def _answers(target, n, seed, max_new=24):
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, 96) for _ in range(rng.randrange(3, 9))] for _ in range(n)]
    results = plain_generate(target, prompts, stop=StopConditions(max_new_tokens=max_new))
    return [{"index": i, "category": "synthetic", "sampled": False, "prompt_ids": p, "answer_ids": list(r.token_ids)}
            for i, (p, r) in enumerate(zip(prompts, results))]


@pytest.fixture(scope="module")
def data_dir(tiny_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("eagle-data")
    rows = _answers(tiny_target, 40, seed=0)
    write_part(out, 0, rows[:20])
    write_part(out, 20, rows[20:])
    return out


@pytest.fixture(scope="module")
def trained_dir(tiny_target, data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle-trained")
    train_eagle(tiny_target, [data_dir], root / "draft", root / "work", recipe=RECIPE, max_steps=40, log=lambda _: None)
    return root / "draft"


@pytest.fixture(scope="module")
def trained_prev_dir(tiny_target, data_dir, trained_dir, tmp_path_factory):
    """A previous_token draft: trained_dir's draft widened (a warm start from its directory) and trained on."""
    import shutil

    root = tmp_path_factory.mktemp("eagle-prev")
    shutil.copytree(trained_dir, root / "draft")
    train_eagle(tiny_target, [data_dir], root / "draft", root / "work", recipe=replace(RECIPE, previous_token=True),
                max_steps=80, resume=True, log=lambda _: None)
    return root / "draft"


@pytest.fixture(scope="module")
def fast_target(tiny_target):
    return FastLlamaLM(copy.deepcopy(tiny_target.model), name=tiny_target.name)


@pytest.fixture(scope="module")
def gguf_target(tiny_target, tmp_path_factory):
    return gguf_copy(tiny_target, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def targets(tiny_target, fast_target, gguf_target):
    """The same weights on each backend: transformers, specdec's fast forward, llama.cpp (float32 GGUF)."""
    return {"hf": tiny_target, "fast": fast_target, "llamacpp": gguf_target}


# --- greedy: lossless ---------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["hf", "fast", "llamacpp"])
@pytest.mark.parametrize("trained", [False, True, "previous token"])
@pytest.mark.parametrize("k", [1, 4])
def test_eagle_greedy_equals_plain(tiny_target, targets, trained_dir, trained_prev_dir, backend, trained, k):
    """On every backend, equal to that backend's own plain decoding (llama.cpp: up to its ties)."""
    target = targets[backend]
    draft = (load_eagle(trained_prev_dir if trained == "previous token" else trained_dir, target,
                        target_name=tiny_target.name) if trained
             else build_eagle(tiny_target, torch.arange(0, 96, 2)))
    got = check_greedy(target, EagleProposer(draft), PROMPTS, StopConditions(max_new_tokens=25), k)
    assert all(len(g.token_ids) == 25 for g in got)
    if trained:  # the trained draft is right often enough that accepted paths are exercised
        assert sum(g.stats.accepted for g in got) > 0


def test_eagle_stops_inside_a_drafted_block_like_plain(tiny_target, trained_dir):
    free = plain_generate(tiny_target, [PROMPTS[0]], stop=StopConditions(max_new_tokens=30))[0].token_ids
    stop = StopConditions(max_new_tokens=30, eos_token_ids=(free[11],))
    got = check_greedy(tiny_target, EagleProposer(load_eagle(trained_dir, tiny_target)), PROMPTS, stop, k=6)
    assert got[0].finish_reason == "stop" and len(got[0].token_ids) <= 12


def test_a_trained_draft_is_accepted_more_than_an_untrained_one(tiny_target, trained_dir):
    rows = _answers(tiny_target, 6, seed=0)  # prompts it was trained on: this checks learning, not generalisation
    prompts, stop = [r["prompt_ids"] for r in rows], StopConditions(max_new_tokens=24)

    def alpha(draft):
        got = speculative_generate(tiny_target, EagleProposer(draft), prompts, stop=stop, k=3)
        return sum(g.stats.accepted for g in got) / sum(g.stats.drafted for g in got)

    assert alpha(load_eagle(trained_dir, tiny_target)) > alpha(build_eagle(tiny_target, torch.arange(64))) + 0.1


def test_engine_runs_eagle_from_its_directory_and_says_how_to_get_one(tiny_target, trained_dir, tmp_path):
    target = LoadedModel(tiny_target, None, "tiny")
    engine = Engine.from_models(target, config=EngineConfig(cost_cache=tmp_path, eagle_dir=str(trained_dir)))
    stop = StopConditions(max_new_tokens=16, eos_token_ids=(10_000,))
    [want] = engine.generate_ids([PROMPTS[2]], "plain", stop=stop)
    [got] = engine.generate_ids([PROMPTS[2]], "eagle", stop=stop, k=3)
    assert_greedy_equal(tiny_target, PROMPTS[2], got.token_ids, want.token_ids)
    bare = Engine.from_models(target, config=EngineConfig(cost_cache=tmp_path))
    with pytest.raises(ModelLoadError, match="specdec train eagle"):
        bare.generate_ids([PROMPTS[0]], "eagle", stop=stop)


def test_a_loop_that_gives_no_features_refuses_eagle(tiny_target, trained_dir):
    env = ProposerEnv(tiny_target, EngineConfig(eagle_dir=str(trained_dir)), costs=None, load_draft=lambda: None)
    with pytest.raises(FailedPrecondition, match="features"):
        load_proposer("eagle", env)


# --- sampling: distributed as the target --------------------------------------------------------

@pytest.fixture(scope="module")
def small_vocab_target():
    return tiny_llama(seed=3, vocab_size=VOCAB, num_layers=2, hidden_size=32, eos_token_id=VOCAB + 10)


@pytest.mark.parametrize("sampling, subset, previous_token, context_vocab", [
    (SamplingParams(temperature=1.0, seed=11), range(VOCAB), False, False),
    (SamplingParams(temperature=0.8, top_k=4, top_p=0.9, seed=12), [0, 2, 3, 5], False, False),
    (SamplingParams(temperature=1.0, seed=13), range(VOCAB), True, False),
    (SamplingParams(temperature=1.0, seed=14), [0, 4], True, True),  # the prompt's 1, 2, 3 draftable too
    (SamplingParams(temperature=1.0, seed=15), range(VOCAB), "copy", False),  # pairs read copy candidates
    (SamplingParams(temperature=1.0, seed=16), [0, 4], "copy", False),  # and draft them outside the subset
])
def test_eagle_sampling_matches_target_distribution(small_vocab_target, sampling, subset, previous_token,
                                                    context_vocab):
    """subset: the tokens the draft may propose (the others have draft probability 0);
    context_vocab: and those of each row's context; previous_token "copy": a draft reading the
    previous token and each pair's copy candidate."""
    lm = small_vocab_target
    draft = build_eagle(lm, torch.tensor(list(subset)), previous_token=bool(previous_token),
                        context_vocab=context_vocab, copy_token=previous_token == "copy")
    results = speculative_generate(lm, EagleProposer(draft), [PROMPT] * ROWS, sampling=sampling,
                                   stop=StopConditions(max_new_tokens=3), k=3)
    assert sum(r.stats.accepted for r in results) > 0, "the draft never got accepted: the test checks nothing"
    _assert_fits(_histogram(results), _joint_probs(lm, sampling))


def test_seeded_eagle_sampling_does_not_depend_on_batch_neighbours(tiny_target, trained_dir):
    sampling, stop = SamplingParams(temperature=0.9, seed=42), StopConditions(max_new_tokens=20)
    draft = load_eagle(trained_dir, tiny_target)

    def first_row(prompts):
        return speculative_generate(tiny_target, EagleProposer(draft), prompts, sampling=sampling, stop=stop,
                                    k=3)[0].token_ids

    assert first_row([PROMPTS[0]]) == first_row([PROMPTS[0], PROMPTS[2], PROMPTS[1]])


# --- the features the loop hands over -----------------------------------------------------------

class FeatureProbe(DraftModelProposer):
    """Drafts with a small draft model (accepted often, sometimes not) and records, per row,
    the committed tokens and the features each propose() call was handed."""

    needs_features = True

    def __init__(self, draft):
        super().__init__(draft)
        self.seen: dict[int, list[tuple[tuple[int, ...], torch.Tensor]]] = {}

    def propose(self, ctx):
        for row, toks, feats in zip(ctx.row_ids, ctx.token_ids, ctx.target_features):
            self.seen.setdefault(row, []).append((toks, feats.clone()))
        return super().propose(ctx)


CPU_LIKE_COST = {1: 1.0, 2: 1.02, 3: 1.57, 5: 1.7}


@pytest.mark.parametrize("backend", ["hf", "fast", "llamacpp"])
@pytest.mark.parametrize("schedule, noise", [(KSchedule(k=3), 0.5),  # a draft accepted often, not always
                                             (KSchedule.cost_aware(CPU_LIKE_COST, draft_cost=0.3), 3.0)])
def test_the_proposer_gets_every_committed_feature_once_as_one_fresh_forward_computes_it(
        tiny_target, targets, backend, schedule, noise):
    """Whatever was accepted, and across steps where nothing was proposed (a bad draft under the
    cost-aware k: plain steps), the features handed over so far are the target's hidden states
    at committed[:-1], as one forward over them computes them (on the same backend)."""
    target = targets[backend]
    probe = FeatureProbe(perturbed_copy(tiny_target, noise=noise, seed=1))
    results = speculative_generate(target, probe, PROMPTS, stop=StopConditions(max_new_tokens=30), k=schedule)
    for row, calls in probe.seen.items():
        handed = torch.cat([feats for _, feats in calls])
        toks = calls[-1][0]
        assert handed.shape[0] == len(toks) - 1  # one per committed position but the last
        ref = target.forward(target.new_cache(1), torch.tensor([list(toks[:-1])]), want_hidden=True).hidden[0]
        torch.testing.assert_close(handed, ref, atol=1e-3 if backend == "llamacpp" else 1e-4, rtol=1e-4)
        counts = [len(t) - 1 for t, _ in calls]  # at every call: handed so far == committed - 1
        assert counts == np.cumsum([f.shape[0] for _, f in calls]).tolist()
    if schedule.verify_cost is None:
        assert sum(r.stats.accepted for r in results) > 0
    else:  # some steps proposed nothing: their features waited for the next call
        assert any(len(probe.seen.get(b, ())) < r.stats.target_forwards - 1 for b, r in enumerate(results))


def test_a_widened_draft_computes_what_it_did_and_reads_the_previous_token_once_trained(tiny_target, trained_dir,
                                                                                       trained_prev_dir):
    """widen_fc keeps the draft's function (its new columns are zero), so training goes on from
    it; the trained previous_token draft's features then depend on the previous token."""
    narrow = load_eagle(trained_dir, tiny_target, drafting_dtype=torch.float32)
    meta = json.loads((trained_dir / "eagle_vocab.json").read_text())
    wide = build_eagle(tiny_target, torch.tensor(meta["token_ids"]), previous_token=True)
    wide.load_state_dict(widen_fc(dict(narrow.state_dict()), 48))
    feats, ids = torch.randn(2, 5, 48), torch.tensor([[5, 6, 7, 8, 9], [3, 3, 4, 4, 5]])
    prev = torch.randint(0, 96, (2, 5))
    torch.testing.assert_close(wide.extend(wide.new_cache(2), feats, ids, previous_ids=prev),
                               narrow.extend(narrow.new_cache(2), feats, ids))
    with pytest.raises(ValueError, match="previous_ids"):
        wide.extend(wide.new_cache(2), feats, ids)
    trained = load_eagle(trained_prev_dir, tiny_target, drafting_dtype=torch.float32)
    assert trained.previous_token and json.loads((trained_prev_dir / "eagle_vocab.json").read_text())["steps"] == 80
    a = trained.extend(trained.new_cache(2), feats, ids, previous_ids=prev)
    b = trained.extend(trained.new_cache(2), feats, ids, previous_ids=(prev + 1) % 96)
    assert (a - b).abs().max() > 1e-3


def recorded_steps(proposer):
    """Each proposal a RecordingEagle made: (row id, its committed tokens, every feature handed to
    the row so far [1, L - 1, F], the proposal)."""
    features: dict[int, list[torch.Tensor]] = {}
    for ctx, proposals in proposer.calls:
        for row, toks, feats, prop in zip(ctx.row_ids, ctx.token_ids, ctx.target_features, proposals):
            features.setdefault(row, []).append(feats)
            yield row, toks, torch.cat(features[row])[None], prop


class RecordingEagle(EagleProposer):
    """Records each call's context and proposals."""

    def __init__(self, draft, **kwargs):
        super().__init__(draft, **kwargs)
        self.calls = []

    def propose(self, ctx):
        proposals = super().propose(ctx)
        self.calls.append((ctx, proposals))
        return proposals


@pytest.mark.parametrize("backend", ["hf", "fast"])
@pytest.mark.parametrize("previous_token", [False, True])
def test_each_step_drafts_what_a_fresh_draft_computes_from_every_feature(tiny_target, fast_target, trained_dir,
                                                                        trained_prev_dir, backend, previous_token):
    """The proposer's rolling cache (drafted pairs dropped, true ones kept, rows leaving) drafts
    what the draft computes from scratch: all true pairs of the committed tokens, then its chain
    (a previous_token draft: each pair with the token before it, committed or drafted)."""
    target = fast_target if backend == "fast" else tiny_target
    draft = load_eagle(trained_prev_dir if previous_token else trained_dir, target)
    proposer = RecordingEagle(draft)
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[2]]
    eos = plain_generate(target, prompts[:1], stop=StopConditions(max_new_tokens=9))[0].token_ids[-1]
    stop = StopConditions(max_new_tokens=24, eos_token_ids=(eos,))  # the first row leaves early
    results = speculative_generate(target, proposer, prompts, stop=stop, k=3)
    assert sum(r.stats.accepted for r in results) > 0
    assert len({ctx.row_ids for ctx, _ in proposer.calls}) > 1  # rows left while others went on
    features: dict[int, list[torch.Tensor]] = {}
    for ctx, proposals in proposer.calls:
        for row, toks, feats, prop in zip(ctx.row_ids, ctx.token_ids, ctx.target_features, proposals):
            features.setdefault(row, []).append(feats)
            pairs = torch.cat(features[row])[None]  # [1, L - 1, H]: f_0..f_{L-2}
            cache = draft.new_cache(1)
            f = draft.extend(cache, pairs, torch.tensor([toks[1:]]), previous_ids=torch.tensor([toks[:-1]]))[:, -1]
            before = toks[-1]
            for d, token in enumerate(prop.token_ids):
                logits = draft.logits(f)[0]
                assert float(logits.max() - logits[token]) < 1e-4, (row, len(toks), d)  # the argmax, up to ties
                f = draft.extend(cache, f[:, None], torch.tensor([[token]]), previous_ids=torch.tensor([[before]]))[:, 0]
                before = token


def test_features_must_continue_what_the_row_holds():
    held = [1, 2, 3, 4]  # true pairs 0..2
    assert feature_start(held, [1, 2, 3, 4, 5, 6], 2) == 3  # positions 3, 4: continues
    assert feature_start(held, [9, 8, 7], 2) == 0  # from position 0: a new sequence
    assert feature_start(held, [1, 2, 3, 9, 9], 2) == 2  # position 2 again: pair 2 is recomputed
    with pytest.raises(ValueError, match="do not continue"):
        feature_start(held, [1, 2, 3, 4, 5, 6, 7, 8], 2)  # positions 4, 5 missing
    with pytest.raises(ValueError, match="do not continue"):
        feature_start(held, [1, 7, 3, 4, 5], 1)  # the tokens before differ
    with pytest.raises(ValueError):
        feature_start(held, [1, 2], 3)  # more features than positions


# --- training -----------------------------------------------------------------------------------

def test_unroll_mask_on_a_four_position_example():
    valid = torch.tensor([[True, True, True, False]])
    step1 = unroll_mask(valid, 1)[0].int().tolist()  # keys: step 0 (true pairs) | step 1
    assert step1 == [[0, 0, 0, 0, 1, 0, 0, 0],  # j = 0: no input at step 1, sees itself only
                     [1, 0, 0, 0, 0, 1, 0, 0],  # j = 1: true pair 0, itself
                     [1, 1, 0, 0, 0, 0, 1, 0],  # j = 2: true pairs 0-1, itself
                     [1, 1, 1, 0, 0, 0, 0, 1]]  # padding: sees itself; nothing sees it
    step2 = unroll_mask(valid, 2)[0, 2].int().tolist()  # j = 2 at step 2: true pair 0, step 1 at 1, itself
    assert step2 == [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0]


@pytest.mark.parametrize("previous_token", [False, True])
def test_unrolled_training_step_s_is_what_drafting_at_depth_s_plus_1_computes(tiny_target, previous_token):
    """Training's step s at position j equals the proposer's chain: true pairs up to j - s in the
    cache, then s pairs of the draft's own features with the true tokens (and the tokens before them)."""
    torch.manual_seed(0)
    draft = build_eagle(tiny_target, torch.arange(96), previous_token=previous_token)
    ids = [5, 17, 33, 2, 40, 8, 11, 60]
    feats = tiny_target.forward(tiny_target.new_cache(1), torch.tensor([ids]), want_hidden=True).hidden  # [1, 8, H]
    tokens, before = torch.tensor([ids[1:]]), torch.tensor([ids[:-1]])  # pair j = (f_j, t_{j+1}; t_j), j = 0..6
    with torch.no_grad():
        outs = unrolled_outputs(draft, feats[:, :7], tokens, torch.ones(1, 7, dtype=torch.bool), unroll=3,
                                previous=before)
    for s in range(3):
        for j in range(s, 7):
            cache = draft.new_cache(1)
            f = draft.extend(cache, feats[:, : j - s + 1], tokens[:, : j - s + 1],
                             previous_ids=before[:, : j - s + 1])[:, -1]
            for d in range(1, s + 1):
                at = slice(j - s + d, j - s + d + 1)
                f = draft.extend(cache, f[:, None], tokens[:, at], previous_ids=before[:, at])[:, 0]
            torch.testing.assert_close(outs[s][0, j], f[0], atol=1e-5, rtol=1e-5)


def test_training_lowers_the_loss_checkpoints_and_resumes(tiny_target, data_dir, tmp_path):
    out, work, lines = tmp_path / "draft", tmp_path / "work", []
    first = train_eagle(tiny_target, [data_dir], out, work, recipe=RECIPE, max_steps=2, log=lines.append)
    assert is_eagle_dir(out) and (work / "checkpoint.pt").is_file() and (out / "RECIPE.md").is_file()
    assert first.step == 2 and torch.load(work / "checkpoint.pt", weights_only=False)["state"]["step"] == 2
    with pytest.raises(InvalidRequest, match="--resume"):
        train_eagle(tiny_target, [data_dir], out, work, recipe=RECIPE, max_steps=4)
    second = train_eagle(tiny_target, [data_dir], out, work, recipe=RECIPE, max_steps=40, resume=True,
                         log=lines.append)
    assert any(line.startswith("resumed at step 2 ") for line in lines)
    assert second.step == 40 and second.tokens_seen > first.tokens_seen  # continued, not restarted
    assert second.history[-1][2] < 0.95 * first.history[-1][2]  # held-out loss fell
    recipe_md = (out / "RECIPE.md").read_text()
    assert "40 steps" in recipe_md and str(data_dir) in recipe_md
    load_eagle(out, tiny_target)  # the directory of the finished run loads


def test_resume_on_a_new_machine_warm_starts_from_the_output_directory(tiny_target, data_dir, tmp_path):
    """The work folder (checkpoint, teacher cache) is gone, as on a fresh machine; the draft
    directory the run wrote is all that is left: resume goes on from it, not from scratch."""
    out, lines = tmp_path / "draft", []
    first = train_eagle(tiny_target, [data_dir], out, tmp_path / "work-1", recipe=RECIPE, max_steps=4,
                        log=lambda _: None)
    with pytest.raises(InvalidRequest, match="another recipe"):
        train_eagle(tiny_target, [data_dir], out, tmp_path / "work-2", recipe=replace(RECIPE, lr=1e-3),
                    max_steps=8, resume=True, log=lambda _: None)
    second = train_eagle(tiny_target, [data_dir], out, tmp_path / "work-2", recipe=RECIPE, max_steps=8,
                         resume=True, log=lines.append)
    assert any(line.startswith("warm start from ") and "at step 4 " in line for line in lines)
    assert second.step == 8 and second.tokens_seen > first.tokens_seen
    assert second.teacher_sequences == 2 * first.teacher_sequences > 0  # the lost cache was computed again
    assert len(second.history) == len(first.history) + 1
    assert json.loads((out / "eagle_vocab.json").read_text())["steps"] == 8


def test_recipe_says_when_the_held_out_set_grew_between_resumed_runs(tiny_target, data_dir, tmp_path):
    """Data added between runs grows the held-out set: the history names each row's held-out size,
    and RECIPE.md says the rows before and after do not compare."""
    import shutil

    data, out = tmp_path / "data", tmp_path / "draft"
    shutil.copytree(data_dir, data)
    first = train_eagle(tiny_target, [data], out, tmp_path / "work", recipe=RECIPE, max_steps=2, log=lambda _: None)
    n_before = first.history[-1][3]
    assert n_before > 0 and "do not compare" not in (out / "RECIPE.md").read_text()
    write_part(data, 40, [dict(row, index=40 + i) for i, row in enumerate(_answers(tiny_target, 30, seed=7))])
    second = train_eagle(tiny_target, [data], out, tmp_path / "work", recipe=RECIPE, max_steps=4, resume=True,
                         log=lambda _: None)
    assert second.history[-1][3] > n_before
    recipe_md = (out / "RECIPE.md").read_text()
    assert f"  {n_before}\n" in recipe_md and f"  {second.history[-1][3]}\n" in recipe_md
    assert "The held-out set changed during the run" in recipe_md


def test_soft_labels_are_the_targets_own_distribution_over_the_subset(tiny_target, trained_dir):
    """EAGLE's token loss: the target's p(next) from its next feature, through its own output rows."""
    from specdec.training.eagle import teacher_probs

    draft = load_eagle(trained_dir, tiny_target)
    ids = torch.tensor([[5, 17, 33, 2, 40, 9]])
    out = tiny_target.forward(tiny_target.new_cache(1), ids, want_hidden=True)
    full = torch.softmax(out.logits[0].float(), dim=-1)[:, draft.token_ids]  # [q, subset]
    torch.testing.assert_close(teacher_probs(draft, out.hidden[0]), full / full.sum(-1, keepdim=True),
                               atol=1e-5, rtol=1e-4)


def test_soft_label_training_learns(tiny_target, data_dir, tmp_path):
    soft = replace(RECIPE, soft_labels=True, token_weight=1.0)
    untrained = train_eagle(tiny_target, [data_dir], tmp_path / "d0", tmp_path / "w0", recipe=soft, max_steps=0,
                            log=lambda _: None)
    state = train_eagle(tiny_target, [data_dir], tmp_path / "draft", tmp_path / "work", recipe=soft, max_steps=40,
                        log=lambda _: None)
    # held-out top-1 agreement at depth 1 and held-out loss, against the same draft untrained
    assert state.history[-1][1][0] > 3 * untrained.history[-1][1][0] + 0.03
    assert state.history[-1][2] < 0.95 * untrained.history[-1][2]


def test_init_starts_a_new_recipe_from_another_drafts_weights(tiny_target, data_dir, trained_dir, tmp_path):
    """--init: a run with another loss (or with the previous token) starts from a draft's weights
    and vocabulary, at step 0 on its own schedule, and its RECIPE.md says where it started."""
    from safetensors.torch import load_file

    out, lines = tmp_path / "draft", []
    soft = replace(RECIPE, soft_labels=True, token_weight=1.0, previous_token=True)
    state = train_eagle(tiny_target, [data_dir], out, tmp_path / "work", recipe=soft, init=trained_dir, max_steps=0,
                        log=lines.append)
    assert state.step == 0 and any(line == f"started from the weights of {trained_dir}" for line in lines)
    before, after = load_file(str(trained_dir / "eagle.safetensors")), load_file(str(out / "eagle.safetensors"))
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        expect = widen_fc({name: tensor.float()}, tensor.shape[0])[name] if name == "fc.weight" else tensor
        torch.testing.assert_close(after[name].float(), expect.float())
    meta = json.loads((out / "eagle_vocab.json").read_text())
    assert meta["token_ids"] == json.loads((trained_dir / "eagle_vocab.json").read_text())["token_ids"]
    assert f"started from the weights of {trained_dir}" in (out / "RECIPE.md").read_text()
    trained = train_eagle(tiny_target, [data_dir], out, tmp_path / "work", recipe=soft, init=trained_dir, max_steps=3,
                          resume=True, log=lines.append)  # resumes its own checkpoint, not the init again
    assert trained.step == 3 and json.loads((out / "eagle_vocab.json").read_text())["init"] == str(trained_dir)
    with pytest.raises(InvalidRequest, match="previous token"):
        train_eagle(tiny_target, [data_dir], tmp_path / "d2", tmp_path / "w2", recipe=RECIPE, init=out, max_steps=0)


def test_a_draft_refuses_another_target(tiny_target, trained_dir, tmp_path):
    with pytest.raises(IncompatibleModels, match="trained for target"):
        load_eagle(trained_dir, tiny_llama(seed=1, vocab_size=96, num_layers=2, hidden_size=48))
    with pytest.raises(IncompatibleModels, match="embedding table"):
        load_eagle(trained_dir, tiny_llama(seed=0, vocab_size=50, num_layers=2, hidden_size=48))
    with pytest.raises(ModelLoadError, match="not an EAGLE draft directory"):
        load_eagle(tmp_path, tiny_target)


def test_a_draft_round_trips_through_its_directory(tiny_target, tmp_path):
    draft = build_eagle(tiny_target, torch.arange(0, 96, 3))
    save_eagle(tmp_path / "d", draft, {"target": tiny_target.name}, dtype=torch.float32)
    again = load_eagle(tmp_path / "d", tiny_target, drafting_dtype=torch.float32)
    feats, ids = torch.randn(1, 4, 48), torch.tensor([[5, 6, 7, 8]])
    a = draft.extend(draft.new_cache(1), feats, ids)
    b = again.extend(again.new_cache(1), feats, ids)
    torch.testing.assert_close(draft.logits(a), again.logits(b))
    assert torch.isfinite(again.logits(b)[0, 0]).nonzero().flatten().tolist() == list(range(0, 96, 3))


def test_a_float32_draft_drafts_in_float16_weights_close_to_its_own(tiny_target, trained_dir):
    """Loaded for drafting, a float32 draft's layer and head run in float16 weights (half the bytes
    a step reads); its features and logits stay within float16 rounding of the float32 ones, and
    a change to the parameters (training, loading) is picked up by the next step."""
    half = load_eagle(trained_dir, tiny_target)
    full = load_eagle(trained_dir, tiny_target, drafting_dtype=torch.float32)
    assert half.drafting().head.dtype == torch.float16 and full.drafting().head.dtype == torch.float32
    feats, ids = torch.randn(1, 6, 48), torch.tensor([[5, 6, 7, 8, 9, 10]])
    a, b = half.extend(half.new_cache(1), feats, ids), full.extend(full.new_cache(1), feats, ids)
    torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    finite = torch.isfinite(full.logits(b))
    torch.testing.assert_close(half.logits(a)[finite], full.logits(b)[finite], atol=5e-2, rtol=5e-2)
    with torch.no_grad():
        full.fc.bias.add_(1.0)  # in place, as an optimizer step
    c = full.extend(full.new_cache(1), feats, ids)
    assert not torch.allclose(b, c)
    with torch.no_grad():
        reference = full(feats, ids, None, torch.arange(6)[None], None)  # transformers' layer, causal by default
    torch.testing.assert_close(c, reference, atol=1e-5, rtol=1e-5)


def test_batch_labels_are_the_targets_next_top1_in_the_subset_beside_the_previous_tokens(tiny_target):
    from specdec.training.eagle import CachedSequence

    to_subset = torch.full((96,), -1, dtype=torch.long)
    to_subset[torch.tensor([4, 7])] = torch.tensor([0, 1])
    seq = CachedSequence(torch.zeros(4, 48, dtype=torch.float16), torch.tensor([1, 2, 3, 4], dtype=torch.int32),
                         torch.tensor([9, 7, 4, 5], dtype=torch.int32), eval_from=1, first=8)
    batch = make_batch([seq], to_subset)
    assert batch.labels[0].tolist() == [1, 0, -1, -1]  # y_{j+1}: 7, 4, 5 (outside), none past the end
    assert batch.previous[0].tolist() == [8, 1, 2, 3]  # t_j beside t_{j+1}: t_0 is the sequence's first
    assert batch.has_target[0].tolist() == [True, True, True, False]
    assert batch.judged[0].tolist() == [False, True, True, False]


def test_context_batch_labels_count_a_token_outside_the_subset_once_its_row_has_seen_it():
    from specdec.training.eagle import CachedSequence

    to_subset = torch.full((96,), -1, dtype=torch.long)
    to_subset[torch.tensor([7, 4])] = torch.tensor([0, 1])
    seq = CachedSequence(torch.zeros(5, 48, dtype=torch.float16), torch.tensor([1, 2, 3, 4, 5], dtype=torch.int32),
                         torch.tensor([9, 1, 3, 2, 4], dtype=torch.int32), eval_from=0, first=8)
    batch = make_batch([seq], to_subset, context_vocab=True)
    assert batch.vocab_ids.tolist() == [7, 4, 1, 2, 3, 5, 8]  # the subset's, then the batch's others
    # y_{j+1} = 1 (seen: t_0..t_1 = 8, 1), 3 (not yet: 8, 1, 2), 2 (seen), 4 (the subset's), none past the end
    assert batch.labels[0].tolist() == [2, -1, 3, 1, -1]
    assert make_batch([seq], to_subset).labels[0].tolist() == [-1, -1, -1, 1, -1]  # the subset's only


def test_a_context_vocab_draft_scores_its_rows_context_tokens_beside_the_subset(tiny_target):
    draft = build_eagle(tiny_target, torch.arange(0, 96, 2), context_vocab=True)
    extra = draft.context_tokens([[3, 4, 5, 3], [6, 8]])
    assert extra.ids.tolist() == [[3, 5], [-1, -1]]  # outside the subset, once each; row 2 has none
    assert build_eagle(tiny_target, torch.arange(0, 96, 2)).context_tokens([[3]]) is None
    feats = torch.randn(2, 3, 48)
    logits = draft.logits(feats, extra)  # [2, 3, vocab]
    reference = feats @ draft.output.T
    allowed = torch.zeros(2, 96, dtype=torch.bool)
    allowed[:, 0::2] = True
    allowed[0, [3, 5]] = True
    assert torch.isinf(logits[~allowed[:, None].expand_as(logits)]).all()
    torch.testing.assert_close(logits[allowed[:, None].expand_as(logits)],
                               reference[allowed[:, None].expand_as(logits)], atol=5e-2, rtol=5e-2)
    ids, logp = draft.top_tokens(feats, 4, extra)
    assert ids.tolist() == logits.topk(4, dim=-1).indices.tolist()
    torch.testing.assert_close(logp, torch.log_softmax(logits.float(), -1).gather(-1, ids), atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def trained_context_dir(tiny_target, data_dir, tmp_path_factory):
    """A context_vocab draft with half the vocabulary as its subset."""
    root = tmp_path_factory.mktemp("eagle-context")
    train_eagle(tiny_target, [data_dir], root / "draft", root / "work", max_steps=60,
                recipe=replace(RECIPE, vocab=48, previous_token=True, context_vocab=True), log=lambda _: None)
    return root / "draft"


@pytest.mark.parametrize("backend", ["hf", "fast", "llamacpp"])
@pytest.mark.parametrize("trained", [False, True])
def test_a_context_vocab_draft_is_lossless_and_drafts_its_subset_and_its_context_s_tokens_only(
        tiny_target, targets, trained_context_dir, backend, trained):
    """Untrained, with a two-token subset, nearly all it drafts is the context's; trained, its
    drafts are accepted. Chains everywhere, trees where the target verifies them."""
    target = targets[backend]
    draft = (load_eagle(trained_context_dir, target, target_name=tiny_target.name) if trained
             else build_eagle(tiny_target, torch.tensor([0, 1]), context_vocab=True))
    subset = set(draft.token_ids.tolist())
    beyond = []

    class Watching(EagleProposer):
        def propose(self, ctx):
            got = super().propose(ctx)
            for toks, p in zip(ctx.token_ids, got):
                assert set(p.token_ids) <= subset | set(toks)
                beyond.extend(set(p.token_ids) - subset)
            return got

    stop = StopConditions(max_new_tokens=25)
    shapes = [{}] + ([{"verify_cost": GPU_LIKE_COST, "runs_trees": True}] if backend != "llamacpp" else [])
    for shape in shapes:
        got = check_greedy(target, Watching(draft, **shape), PROMPTS, stop, 4)
        if trained:
            assert sum(g.stats.accepted for g in got) > 0
    if not trained:
        assert beyond, "no token outside the subset was drafted: the test checks nothing"


def test_the_context_vocab_recipe_round_trips_and_refuses_soft_labels(tiny_target, data_dir, trained_context_dir,
                                                                      tmp_path):
    assert json.loads((trained_context_dir / "eagle_vocab.json").read_text())["context_vocab"] is True
    with pytest.raises(InvalidRequest, match="soft labels"):
        train_eagle(tiny_target, [data_dir], tmp_path / "d", tmp_path / "w", max_steps=1, log=lambda _: None,
                    recipe=replace(RECIPE, soft_labels=True, context_vocab=True))


# --- trees where verification is about as cheap as the chain's ---------------------------------

def test_a_tree_replaces_the_chain_only_where_it_costs_about_the_chain_to_verify():
    from specdec.proposers.eagle import MAX_TREE_NODES, tree_nodes

    assert tree_nodes(GPU_LIKE_COST, 4, runs_trees=True) == MAX_TREE_NODES
    assert tree_nodes(LLAMACPP_CPU_COST, 4, runs_trees=True) == 4  # the chain
    assert tree_nodes(GPU_LIKE_COST, 4, runs_trees=False) == 4  # llama.cpp verifies chains only
    assert tree_nodes(None, 4, runs_trees=True) == 4  # cost unknown: the chain
    assert tree_nodes(GPU_LIKE_COST, 0, runs_trees=True) == 0
    # v(5) = 1.0125, so the tree may cost 1.114: v(23) = 1.106 fits, v(24) = 1.116 does not
    rising = {1: 1.0, 17: 1.05, 33: 1.2}
    assert tree_nodes(rising, 4, runs_trees=True) == 22
    assert tree_nodes(rising, 4, runs_trees=True, reserve=4) == 18  # room left for a 4-token branch


def test_a_tree_keeps_the_chain_then_the_best_scored_nodes_whose_parents_it_holds():
    from specdec.eagle_tree import choose_nodes

    #          0     1     2     3     4     5     6
    scores = [-0.1, -1.0, -2.0, -0.3, -0.5, -1.2, -0.6]
    parents = [-1, -1, -1, 0, 0, 1, 3]
    depths = [1, 1, 1, 2, 2, 2, 3]
    chain = [0, 4, 6]  # the greedy chain need not be the best-scored path (4 scores below 3)
    assert choose_nodes(scores, parents, depths, chain, nodes=3, depth=3) == [0, 4, 6]
    assert choose_nodes(scores, parents, depths, chain, nodes=5, depth=3) == [0, 1, 3, 4, 6]
    assert choose_nodes(scores, parents, depths, chain, nodes=5, depth=2) == [0, 1, 3, 4, 5]  # 6 too deep: 5 instead
    # node 6's parent 3 outranks it, so a tree holding 6 holds 3 (ties: the shallower first)
    assert choose_nodes([-1.0, -1.0, -1.0], [-1, 0, 1], [1, 2, 3], [0], nodes=3, depth=3) == [0, 1, 2]


def _path_top(draft, committed_cache, root, last, path, topk, index=None):
    """The draft's top-k after the path's tokens, drafted as a chain on a copy of the cache (a
    copy_token draft's pairs reading the candidates index gives after each path prefix)."""
    cache = copy.deepcopy(committed_cache)
    feature, before = root, last
    for i, tok in enumerate(path):
        copies = None if index is None else torch.tensor([[index.candidate(path[: i + 1])]])
        feature = draft.extend(cache, feature[None, None], torch.tensor([[tok]]), previous_ids=torch.tensor([[before]]),
                               copy_ids=copies)[0, 0]
        before = tok
    copies = None if index is None else torch.tensor(index.candidate(path))  # draftable beside the subset
    return draft.top_tokens(feature, topk, copies=copies)[0].tolist()


@pytest.mark.parametrize("prev", [False, True, "copy"])
def test_a_dynamic_tree_holds_the_chain_and_each_node_is_among_its_path_s_top_candidates(
        tiny_target, trained_dir, trained_prev_dir, trained_copy_dir, prev):
    """Every node of a drafted tree is what drafting its path as a chain would rank among the
    top-k (the tree's attention mask and positions give each node its own path's context), the
    greedy chain is in it, it has as many nodes as asked, and the cache is left as it was."""
    from specdec.copy_tokens import NONE, CopyIndex
    from specdec.eagle_tree import draft_trees

    path = {False: trained_dir, True: trained_prev_dir, "copy": trained_copy_dir}[prev]
    draft = load_eagle(path, tiny_target, target_name=tiny_target.name).float()
    gen = torch.Generator().manual_seed(0)
    hidden = draft.head.shape[1]
    if draft.copy_token:  # the candidates weigh much more: a node reading another path's shows
        with torch.no_grad():
            draft.fc.weight[:, -hidden:] *= 30
    rows = [[5, 17, 33, 2, 40, 8, 33, 2], [9, 9, 60, 12, 9]]
    indexes = [CopyIndex() for _ in rows]
    for index, r in zip(indexes, rows):
        index.extend(r)
    cache = draft.new_cache(2)
    n = max(len(r) for r in rows) - 1
    feats = torch.randn(2, n, hidden, generator=gen)
    ids = torch.zeros(2, n, dtype=torch.long)
    prevs = torch.zeros(2, n, dtype=torch.long)
    valid = torch.zeros(2, n, dtype=torch.bool)
    copies = torch.full((2, n), NONE, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r) - 1], prevs[b, : len(r) - 1], valid[b, : len(r) - 1] = torch.tensor(r[1:]), torch.tensor(r[:-1]), True
        copies[b, : len(r) - 1] = torch.tensor(indexes[b].candidates[1:])
    out = draft.extend(cache, feats, ids, valid, previous_ids=prevs, copy_ids=copies)
    roots = torch.stack([out[b, len(r) - 2] for b, r in enumerate(rows)])
    last = torch.tensor([r[-1] for r in rows])
    before = (cache.valid.clone(), cache.num_slots)
    per_row = [copy.deepcopy(cache) for _ in rows]
    for b in range(2):
        per_row[b].select_rows(torch.tensor([b]))
    index_of = indexes if draft.copy_token else [None, None]
    trees = draft_trees(draft, cache, roots, last, depths=[4, 3], nodes=[12, 7], topk=3,
                        copies=indexes if draft.copy_token else None)
    assert torch.equal(cache.valid, before[0]) and cache.num_slots == before[1]
    for b, (tree, depth, nodes) in enumerate(zip(trees, [4, 3], [12, 7])):
        assert len(tree.token_ids) == nodes and max(tree.depths) <= depth
        paths = []
        for i, p in enumerate(tree.parents):
            assert p < i and tree.depths[i] == (1 if p == -1 else tree.depths[p] + 1)
            paths.append(([] if p == -1 else paths[p]) + [tree.token_ids[i]])
            top = _path_top(draft, per_row[b], roots[b], int(last[b]), paths[i][:-1], 3, index_of[b])
            assert tree.token_ids[i] in top
        chain = []
        for _ in range(depth):
            chain.append(_path_top(draft, per_row[b], roots[b], int(last[b]), chain, 1, index_of[b])[0])
        assert chain in paths


@pytest.mark.parametrize("backend", ["hf", "fast"])
@pytest.mark.parametrize("trained", [False, True])
def test_an_eagle_tree_is_lossless_and_accepts_at_least_what_its_chain_does(tiny_target, targets, trained_dir,
                                                                            backend, trained):
    """Greedy with siblings equals plain decoding; the chain is part of the tree, so the tree's
    accepted path is never shorter, and for the trained draft a depth the chain gets wrong is
    sometimes right among the siblings (more accepted tokens, fewer target forwards)."""
    target = targets[backend]
    draft = (load_eagle(trained_dir, target, target_name=tiny_target.name) if trained
             else build_eagle(tiny_target, torch.arange(0, 96, 2)))
    stop = StopConditions(max_new_tokens=25)
    chain = check_greedy(target, EagleProposer(draft), PROMPTS, stop, 4)
    tree = check_greedy(target, EagleProposer(draft, verify_cost=GPU_LIKE_COST, runs_trees=True), PROMPTS, stop, 4)
    accepted = lambda results: sum(r.stats.accepted for r in results)  # noqa: E731
    forwards = lambda results: sum(r.stats.target_forwards for r in results)  # noqa: E731
    assert accepted(tree) >= accepted(chain) and forwards(tree) <= forwards(chain)
    if trained:
        assert accepted(tree) > accepted(chain) and forwards(tree) < forwards(chain)


def test_the_eagle_loader_hands_a_tree_verifying_target_s_measured_cost_to_its_proposers(tiny_target, trained_dir,
                                                                                           tmp_path):
    from specdec.costmodel import CostStore

    costs = CostStore(tmp_path / "costs")
    env = ProposerEnv(tiny_target, EngineConfig(eagle_dir=str(trained_dir)), costs=costs, load_draft=lambda: None,
                      gives_features=True)
    proposer = load_proposer("eagle", env)()
    assert proposer.runs_trees and proposer.verify_cost == costs.verify_cost(tiny_target)


def test_auto_weighs_the_eagle_draft_once_it_has_run_here(tiny_target, trained_dir, tmp_path):
    """After an EAGLE run, auto knows its acceptance and measures its step's cost (kept in the
    store); on a GPU-like verify cost a draft that is right nearly always and cheap is what auto
    runs, and its output is plain's."""
    from specdec.eagle import step_cost
    from tests.conftest import FixedCosts

    class Costs(FixedCosts):  # the draft's step cost as given (what a GPU gives), not this host's
        def figure(self, key, what, measure, timed=True):
            return 0.1 if key["figure"] == "eagle_cost" else super().figure(key, what, measure, timed)

    costs = Costs(GPU_LIKE_COST)
    engine = Engine.from_models(LoadedModel(tiny_target, None, "tiny"), costs=costs,
                                config=EngineConfig(eagle_dir=str(trained_dir)))
    rows = _answers(tiny_target, 6, seed=0)  # prompts it was trained on: accepted often
    prompts, stop = [r["prompt_ids"] for r in rows], StopConditions(max_new_tokens=24, eos_token_ids=(10_000,))
    costs.add_acceptance(tiny_target, "prompt-lookup", drafted=1000, accepted=10)  # lookup measured poor here
    assert engine.resolve_method("auto") == "plain"
    [ran] = engine.generate_ids(prompts[:1], "eagle", stop=stop, k=4)
    assert costs.acceptance(tiny_target, "eagle", str(trained_dir)) == ran.stats.accepted / ran.stats.drafted
    assert 0 < step_cost(load_eagle(trained_dir, tiny_target), tiny_target) < 10  # a finite ratio of two timings
    # once it has been right nearly always (a long window of it), it is what auto runs
    costs.add_acceptance(tiny_target, "eagle", drafted=40_000, accepted=39_000, proposer=str(trained_dir))
    assert engine.resolve_method("auto") == "eagle"
    [got] = engine.generate_ids(prompts[:1], "auto", stop=stop, k=4)
    [want] = engine.generate_ids(prompts[:1], "plain", stop=stop)
    assert_greedy_equal(tiny_target, prompts[0], got.token_ids, want.token_ids) and got.stats.drafted > 0


def test_layer_states_are_the_residual_stream_the_forward_runs_through(fast_target):
    """layer_states: after the last layer, normed, they are the forward's features; earlier
    layers come in the order asked; a layer the target lacks is refused."""
    ids = torch.tensor([[5, 17, 33, 2, 40, 9], [9, 9, 60, 12, 7, 88]])
    out = fast_target.forward(fast_target.new_cache(2), ids, want_hidden=True)
    last = fast_target.layer_states(ids, (1,))
    torch.testing.assert_close(torch.nn.functional.rms_norm(last, (48,), fast_target.norm, fast_target.eps),
                               out.hidden)
    both = fast_target.layer_states(ids, (1, 0))
    assert both.shape == (2, 6, 96)
    torch.testing.assert_close(both[..., :48], last)
    torch.testing.assert_close(both[..., 48:], fast_target.layer_states(ids, (0,)))
    assert (both[..., 48:] - last).abs().max() > 1e-3
    with pytest.raises(ValueError, match="below 2"):
        fast_target.layer_states(ids, (2,))


@pytest.fixture(scope="module")
def trained_taps_dir(fast_target, data_dir, trained_prev_dir, tmp_path_factory):
    """A draft reading the target's residuals after layer 0: trained_prev_dir's widened (--init) and trained on."""
    root = tmp_path_factory.mktemp("eagle-taps")
    recipe = replace(RECIPE, previous_token=True, tap_layers=(0,))
    train_eagle(fast_target, [data_dir], root / "draft", root / "work", recipe=recipe, init=trained_prev_dir,
                max_steps=40, log=lambda _: None)
    return root / "draft"


def test_a_tap_layers_draft_starts_as_the_draft_it_widens_and_reads_the_taps_once_trained(
        fast_target, data_dir, trained_prev_dir, trained_taps_dir, tmp_path):
    """--init from a draft without taps: fc's new columns are zero, so the widened draft computes
    what its init did, whatever the taps; trained, its features depend on them, and a drafted
    pair (no taps) reads zeros there. The layers round-trip through the directory."""
    recipe = replace(RECIPE, previous_token=True, tap_layers=(0,))
    train_eagle(fast_target, [data_dir], tmp_path / "d", tmp_path / "w", recipe=recipe, init=trained_prev_dir,
                max_steps=0, log=lambda _: None)
    narrow = load_eagle(trained_prev_dir, fast_target, drafting_dtype=torch.float32)
    wide = load_eagle(tmp_path / "d", fast_target, drafting_dtype=torch.float32)
    trained = load_eagle(trained_taps_dir, fast_target, drafting_dtype=torch.float32)
    assert wide.tap_layers == trained.tap_layers == (0,) and narrow.tap_layers == ()
    feats, ids = torch.randn(2, 5, 48), torch.tensor([[5, 6, 7, 8, 9], [3, 3, 4, 4, 5]])
    prev, taps = torch.randint(0, 96, (2, 5)), 30 * torch.randn(2, 5, 48)
    torch.testing.assert_close(wide.extend(wide.new_cache(2), feats, ids, previous_ids=prev, taps=taps),
                               narrow.extend(narrow.new_cache(2), feats, ids, previous_ids=prev))
    a = trained.extend(trained.new_cache(2), feats, ids, previous_ids=prev, taps=taps)
    b = trained.extend(trained.new_cache(2), feats, ids, previous_ids=prev, taps=-taps)
    none = trained.extend(trained.new_cache(2), feats, ids, previous_ids=prev)
    zero = trained.extend(trained.new_cache(2), feats, ids, previous_ids=prev, taps=torch.zeros_like(taps))
    assert (a - b).abs().max() > 1e-3
    torch.testing.assert_close(none, zero)
    # the scale of a layer's residuals does not matter: each is normalized
    torch.testing.assert_close(trained.extend(trained.new_cache(2), feats, ids, previous_ids=prev, taps=taps / 30), a)


def test_tap_training_needs_a_target_that_returns_its_layers_and_layers_it_has(tiny_target, fast_target, data_dir,
                                                                             trained_taps_dir, tmp_path):
    recipe = replace(RECIPE, previous_token=True, tap_layers=(0,))
    with pytest.raises(InvalidRequest, match="fast backend"):
        train_eagle(tiny_target, [data_dir], tmp_path / "a", tmp_path / "wa", recipe=recipe, max_steps=1)
    with pytest.raises(InvalidRequest, match="layers are 0..1"):
        train_eagle(fast_target, [data_dir], tmp_path / "b", tmp_path / "wb", recipe=replace(recipe, tap_layers=(2,)),
                    max_steps=1)
    with pytest.raises(InvalidRequest, match="--tap-layers 0"):  # an init with other taps
        train_eagle(fast_target, [data_dir], tmp_path / "c", tmp_path / "wc", recipe=replace(recipe, tap_layers=(1,)),
                    init=trained_taps_dir, max_steps=0)


def test_the_unrolled_steps_read_the_taps_at_step_0_only(fast_target, trained_taps_dir):
    """Training's step 0 runs on the target's true pairs, taps included; steps s > 0 feed the
    draft's own features, where the target has computed no residuals: they read none."""
    draft = load_eagle(trained_taps_dir, fast_target).float()
    feats, ids = torch.randn(1, 6, 48), torch.randint(0, 96, (1, 6))
    prev, valid, taps = torch.randint(0, 96, (1, 6)), torch.ones(1, 6, dtype=torch.bool), torch.randn(1, 6, 48)
    with torch.no_grad():
        outs = unrolled_outputs(draft, feats, ids, valid, 2, prev, taps)
        step0 = draft.extend(draft.new_cache(1), feats, ids, previous_ids=prev, taps=taps)
        torch.testing.assert_close(outs[0], step0, atol=2e-3, rtol=2e-3)
        shifted = torch.cat([torch.zeros_like(outs[0][:, :1]), outs[0][:, :-1]], dim=1)
        cache = draft.new_cache(1)
        draft.extend(cache, feats[:, :1], ids[:, :1], previous_ids=prev[:, :1], taps=taps[:, :1])
        # the depth-2 input at position 1: after the true pair 0, the draft's own f^_1, no taps
        depth2 = draft.extend(cache, shifted[:, 1:2], ids[:, 1:2], previous_ids=prev[:, 1:2])
        torch.testing.assert_close(outs[1][:, 1:2], depth2, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("k", [1, 4])
def test_a_tap_layers_draft_is_lossless_and_drafts_from_the_residuals_the_target_computed(
        fast_target, trained_taps_dir, k):
    """On the fast backend the loop hands a tap_layers draft, beside each committed position's
    feature, the target's residuals after its layers there (what a fresh forward over the
    committed tokens computes), and each step drafts what the draft computes from scratch on
    them; greedy output equals plain decoding's."""
    draft = load_eagle(trained_taps_dir, fast_target)
    proposer = RecordingEagle(draft)
    got = check_greedy(fast_target, proposer, PROMPTS, StopConditions(max_new_tokens=25), k)
    assert sum(g.stats.accepted for g in got) > 0
    for row, toks, pairs, prop in recorded_steps(proposer):  # pairs [1, L - 1, 2 H]: (f_p ; residual after layer 0)
        assert pairs.shape == (1, len(toks) - 1, 96)
        torch.testing.assert_close(pairs[..., 48:], fast_target.layer_states(torch.tensor([toks[:-1]]), (0,)),
                                   atol=1e-4, rtol=1e-4)
        cache = draft.new_cache(1)
        f = draft.extend(cache, pairs[..., :48], torch.tensor([toks[1:]]), previous_ids=torch.tensor([toks[:-1]]),
                         taps=pairs[..., 48:])[:, -1]
        before = toks[-1]
        for token in prop.token_ids:
            logits = draft.logits(f)[0]
            assert float(logits.max() - logits[token]) < 1e-4, (row, len(toks))
            f = draft.extend(cache, f[:, None], torch.tensor([[token]]), previous_ids=torch.tensor([[before]]))[:, 0]
            before = token


def test_a_tap_layers_draft_is_refused_on_a_backend_that_does_not_return_the_layers(tiny_target, trained_taps_dir):
    env = ProposerEnv(tiny_target, EngineConfig(eagle_dir=str(trained_taps_dir)), costs=None,
                      load_draft=lambda: None, gives_features=True)
    with pytest.raises(FailedPrecondition, match="the hf backend does not return them: run the target on the fast"):
        load_proposer("eagle", env)


def test_eagle_eval_scores_each_tap_draft_on_its_own_layers_when_drafts_with_other_layers_are_compared(
        fast_target, trained_taps_dir):
    """compare() computes the residuals of every draft's layers once and hands each draft its
    own: a draft's figures beside a draft with other layers are those it gets alone."""
    from specdec.training.eagle_eval import compare

    other = load_eagle(trained_taps_dir, fast_target)
    other.tap_layers = (1,)  # the same weights reading layer 1's residuals: other figures
    drafts = {"layer 0": load_eagle(trained_taps_dir, fast_target), "layer 1": other}
    prompts = [("synthetic", p) for p in PROMPTS]
    together = compare(fast_target, drafts, prompts, max_new_tokens=12, k=3)
    for name, draft in drafts.items():
        assert compare(fast_target, {name: draft}, prompts, max_new_tokens=12, k=3)[name] == together[name]
    assert together["layer 0"]["all"] != together["layer 1"]["all"], "the layers' figures agree: the test shows nothing"


# --- copy candidates (copy_token) ------------------------------------------------------------

def test_copy_candidates_are_what_prompt_lookup_drafts_one_token_deep_committed_or_drafted():
    """copy_candidates(ids)[i] is the first token prompt lookup drafts after ids[: i + 1]; the
    index drafting keeps gives the same after committed tokens plus any drafted path."""
    from specdec.copy_tokens import NONE, CopyIndex, copy_candidates
    from specdec.proposers.prompt_lookup import find_continuation

    assert copy_candidates([5, 6, 7, 5, 6]) == [NONE, NONE, NONE, 6, 7]
    rng = random.Random(0)
    for _ in range(400):
        ids = [rng.randrange(rng.randint(1, 6)) for _ in range(rng.randint(1, 24))]
        want = [(find_continuation(ids[: i + 1], 1) or (NONE,))[0] for i in range(len(ids))]
        assert copy_candidates(ids) == want, ids
        cut = rng.randint(1, len(ids))
        index = CopyIndex()
        index.extend(ids[:cut])
        for end in range(cut, len(ids) + 1):
            assert index.candidate(ids[cut:end]) == want[end - 1], (ids, cut, end)


@pytest.fixture(scope="module")
def trained_copy_dir(tiny_target, data_dir, trained_prev_dir, tmp_path_factory):
    """A copy_token draft: trained_prev_dir's widened (--init) and trained on."""
    root = tmp_path_factory.mktemp("eagle-copy")
    train_eagle(tiny_target, [data_dir], root / "draft", root / "work", init=trained_prev_dir, max_steps=60,
                recipe=replace(RECIPE, previous_token=True, copy_token=True), log=lambda _: None)
    return root / "draft"


def test_a_copy_token_draft_starts_as_the_draft_it_widens_and_reads_the_candidate_once_trained(
        tiny_target, data_dir, trained_prev_dir, trained_copy_dir, tmp_path):
    recipe = replace(RECIPE, previous_token=True, copy_token=True)
    train_eagle(tiny_target, [data_dir], tmp_path / "d", tmp_path / "w", recipe=recipe, init=trained_prev_dir,
                max_steps=0, log=lambda _: None)
    narrow = load_eagle(trained_prev_dir, tiny_target, drafting_dtype=torch.float32)
    wide = load_eagle(tmp_path / "d", tiny_target, drafting_dtype=torch.float32)
    trained = load_eagle(trained_copy_dir, tiny_target, drafting_dtype=torch.float32)
    assert wide.copy_token and trained.copy_token and not narrow.copy_token
    feats, ids = torch.randn(2, 5, 48), torch.tensor([[5, 6, 7, 8, 9], [3, 3, 4, 4, 5]])
    prev, copies = torch.randint(0, 96, (2, 5)), torch.randint(-1, 96, (2, 5))
    torch.testing.assert_close(wide.extend(wide.new_cache(2), feats, ids, previous_ids=prev, copy_ids=copies),
                               narrow.extend(narrow.new_cache(2), feats, ids, previous_ids=prev))
    with pytest.raises(ValueError, match="copy_ids"):
        wide.extend(wide.new_cache(2), feats, ids, previous_ids=prev)
    a = trained.extend(trained.new_cache(2), feats, ids, previous_ids=prev, copy_ids=copies)
    b = trained.extend(trained.new_cache(2), feats, ids, previous_ids=prev, copy_ids=(copies + 2) % 96)
    assert (a - b).abs().max() > 1e-3
    # no candidate (-1) reads zeros, not some token's embedding
    none = trained.extend(trained.new_cache(2), feats, ids, previous_ids=prev, copy_ids=torch.full((2, 5), -1))
    x = torch.cat([feats, trained.embed[ids], trained.embed[prev], torch.zeros(2, 5, 48)], dim=-1)
    ref = trained.layer(trained.fc(x), attention_mask=None, position_ids=torch.arange(5).expand(2, 5),
                        position_embeddings=trained.rotary(x, torch.arange(5).expand(2, 5)))
    torch.testing.assert_close(none, ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(InvalidRequest, match="--copy-token"):  # an init that reads candidates needs them
        train_eagle(tiny_target, [data_dir], tmp_path / "e", tmp_path / "we", init=trained_copy_dir, max_steps=0,
                    recipe=replace(RECIPE, previous_token=True))


def test_unrolled_training_reads_the_copy_candidates_drafting_reads_at_every_depth(tiny_target):
    """Step s at j equals drafting's chain after the true pairs up to j - s, each drafted pair
    reading the candidate after the committed tokens and the path drafted so far (CopyIndex)."""
    from specdec.copy_tokens import CopyIndex
    from specdec.training.eagle import CachedSequence

    torch.manual_seed(0)
    draft = build_eagle(tiny_target, torch.arange(96), previous_token=True, copy_token=True)
    ids = [5, 17, 5, 17, 40, 5, 17, 40, 60]
    feats = tiny_target.forward(tiny_target.new_cache(1), torch.tensor([ids]), want_hidden=True).hidden
    tokens, before = torch.tensor([ids[1:]]), torch.tensor([ids[:-1]])
    seq = CachedSequence(features=feats[0, :8].half(), tokens=tokens[0].int(), top1=tokens[0].int(), eval_from=0,
                         first=ids[0])
    copies = make_batch([seq], torch.arange(96)).copies  # what training reads
    assert (copies >= 0).sum() >= 4
    with torch.no_grad():
        outs = unrolled_outputs(draft, feats[:, :8], tokens, torch.ones(1, 8, dtype=torch.bool), unroll=3,
                                previous=before, copies=copies)
    for s in range(3):
        for j in range(s, 8):
            n = j - s + 1  # true pairs 0..j - s: committed ids[: n + 1]
            index = CopyIndex()
            index.extend(ids[: n + 1])
            cache = draft.new_cache(1)
            f = draft.extend(cache, feats[:, :n], tokens[:, :n], previous_ids=before[:, :n],
                             copy_ids=torch.tensor([index.candidates[1:]]))[:, -1]
            for d in range(1, s + 1):
                path = ids[n + 1 : n + 1 + d]
                f = draft.extend(cache, f[:, None], torch.tensor([[path[-1]]]),
                                 previous_ids=torch.tensor([[ids[n + d - 1]]]),
                                 copy_ids=torch.tensor([[index.candidate(path)]]))[:, 0]
            torch.testing.assert_close(outs[s][0, j], f[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["hf", "fast", "llamacpp"])
@pytest.mark.parametrize("k", [1, 4])
def test_a_copy_token_draft_is_lossless_and_drafts_from_the_candidates_of_its_context(
        tiny_target, targets, trained_copy_dir, backend, k):
    """Greedy equals plain decoding; each step drafts what the draft computes from scratch with
    every pair's candidate taken from the committed tokens and the chain drafted before it."""
    from specdec.copy_tokens import copy_candidates

    target = targets[backend]
    draft = load_eagle(trained_copy_dir, target, target_name=tiny_target.name)
    proposer = RecordingEagle(draft)
    prompts = PROMPTS + [[7, 8, 9, 7, 8, 9, 7, 8]]
    got = check_greedy(target, proposer, prompts, StopConditions(max_new_tokens=25), k)
    assert sum(g.stats.accepted for g in got) > 0
    for row, toks, pairs, prop in recorded_steps(proposer):
        cache = draft.new_cache(1)
        f = draft.extend(cache, pairs, torch.tensor([toks[1:]]), previous_ids=torch.tensor([toks[:-1]]),
                         copy_ids=torch.tensor([copy_candidates(toks)[1:]]))[:, -1]
        seq = list(toks)
        for token in prop.token_ids:
            logits = draft.logits(f, copies=torch.tensor([copy_candidates(seq)[-1]]))[0]
            assert float(logits.max() - logits[token]) < 1e-4, (row, len(toks))
            seq.append(token)
            f = draft.extend(cache, f[:, None], torch.tensor([[token]]), previous_ids=torch.tensor([[seq[-2]]]),
                             copy_ids=torch.tensor([[copy_candidates(seq)[-1]]]))[:, 0]


def loud_copy_draft(target, subset):
    """A copy_token draft that follows its candidates: fc maps a candidate's embedding onto its
    output row, loudly (what a trained draft learns where answers copy)."""
    torch.manual_seed(0)
    draft = build_eagle(target, subset, previous_token=True, copy_token=True).float()
    hidden = draft.head.shape[1]
    with torch.no_grad():
        draft.fc.weight[:, -hidden:] = 100 * torch.linalg.lstsq(draft.embed, draft.output).solution.T
    return draft


@pytest.mark.parametrize("backend", ["hf", "fast", "llamacpp"])
def test_a_copy_token_draft_drafts_its_candidate_outside_its_subset_and_stays_lossless(tiny_target, targets, backend):
    """A candidate outside the subset is draftable (scored by the target's output row): a draft
    that follows its candidates drafts such tokens in chains and trees, the target accepts
    some, and the output is plain decoding's."""
    subset = torch.arange(0, 96, 2)
    draft = loud_copy_draft(tiny_target, subset)
    prompts = [[7, 9, 11, 7, 9, 11, 7, 9], [5, 17, 33, 3, 41, 5, 17, 33], [13, 15, 13, 15, 13]]
    stop = StopConditions(max_new_tokens=20)
    proposer = RecordingEagle(draft)
    got = check_greedy(targets[backend], proposer, prompts, stop, 4)
    drafted = [t for _, proposals in proposer.calls for p in proposals for t in p.token_ids]
    outside = [t for t in drafted if t % 2 == 1]
    assert outside and sum(g.stats.accepted for g in got) > 0, (drafted, [g.stats.accepted for g in got])
    if backend != "llamacpp":  # trees too (GPU-like verify cost)
        tree = RecordingEagle(draft, verify_cost=GPU_LIKE_COST, runs_trees=True)
        assert sum(g.stats.accepted for g in check_greedy(targets[backend], tree, prompts, stop, 4)) > 0
        nodes = [t for _, proposals in tree.calls for p in proposals for t in p.token_ids]
        assert any(p.parents for _, proposals in tree.calls for p in proposals)
        assert [t for t in nodes if t % 2 == 1], nodes


def test_a_greedy_chain_over_the_draftable_tokens_drafts_the_vocabulary_argmax_s_chain(tiny_target):
    """The chain's greedy steps pick among the tokens a draft can draft (EagleDraft.scores: its
    subset, its copy candidate) rather than over the vocabulary: the same tokens, candidates
    outside the subset included, and the same probabilities."""
    from specdec.proposers.draft_model import draft_chain
    from specdec.proposers.eagle import greedy_chain

    draft = loud_copy_draft(tiny_target, torch.arange(0, 96, 2))
    gen = torch.Generator().manual_seed(3)
    features = [torch.randn(2, 48, generator=gen) for _ in range(4)]
    copies = [torch.tensor([5, -1]), torch.tensor([9, 4]), torch.tensor([-1, 31]), torch.tensor([7, 7])]
    features[1][0] = 10 * draft.output[9]  # step 1's row 0 and step 2's row 1 favour their candidates
    features[2][1] = 10 * draft.output[31]
    ids, scores = draft.scores(features[0], copies=copies[0])
    assert ids[0, -1] == 5 and ids[1, -1] == -1 and torch.isneginf(scores[1, -1])  # 5 is outside the subset
    full = draft.logits(features[0], copies=copies[0])
    torch.testing.assert_close(torch.softmax(scores, -1).max(-1).values, torch.softmax(full, -1).max(-1).values)
    seen = {"vocab": [], "draftable": []}

    def feeder(score, kind):
        step = iter(range(1, 4))

        def feed(tok):
            seen[kind].append(tok.tolist())
            i = next(step)
            return score(features[i], copies=copies[i])
        return feed

    chain = greedy_chain(draft.scores(features[0], copies=copies[0]), feeder(draft.scores, "draftable"), 4)
    reference, _ = draft_chain(full, feeder(draft.logits, "vocab"), 4, SamplingParams(), None)
    assert chain.tolist() == reference.tolist() and seen["draftable"] == seen["vocab"]
    assert chain[0, 1] == 9 and chain[1, 2] == 31, chain  # candidates outside the subset, drafted


@pytest.mark.parametrize("backend", ["hf", "fast"])
def test_a_copy_token_draft_s_trees_are_lossless_and_hold_its_chain(tiny_target, targets, trained_copy_dir, backend):
    target = targets[backend]
    draft = load_eagle(trained_copy_dir, target, target_name=tiny_target.name)
    stop = StopConditions(max_new_tokens=25)
    chain = check_greedy(target, EagleProposer(draft), PROMPTS, stop, 4)
    tree = check_greedy(target, EagleProposer(draft, verify_cost=GPU_LIKE_COST, runs_trees=True), PROMPTS, stop, 4)
    assert sum(r.stats.accepted for r in tree) >= sum(r.stats.accepted for r in chain) > 0


def test_a_draft_of_another_shape_in_the_same_directory_gets_its_own_measured_cost(tiny_target):
    """The stored c is keyed by what a step's cost grows with: a newer shipped draft that reads
    more inputs (or drafts a larger subset) is measured anew, not charged the older one's c."""
    from specdec.proposers.eagle import eagle_cost
    from tests.conftest import FixedCosts

    keys = []

    class Costs(FixedCosts):  # records the keys it is asked for, measures nothing
        def figure(self, key, what, measure, timed=True):
            keys.append(key)
            return 0.1

    costs = Costs(GPU_LIKE_COST)
    shapes = [dict(), dict(previous_token=True), dict(previous_token=True, copy_token=True)]
    for kw in shapes:
        eagle_cost(costs, build_eagle(tiny_target, torch.arange(96), **kw), tiny_target, None)
    eagle_cost(costs, build_eagle(tiny_target, torch.arange(64)), tiny_target, None)
    eagle_cost(costs, build_eagle(tiny_target, torch.arange(96)), tiny_target, None)  # the first's shape again
    assert len({json.dumps(k, sort_keys=True) for k in keys}) == 4
    assert keys[0] == keys[-1]


def test_copy_labels_count_a_label_outside_the_subset_where_it_is_the_pair_s_candidate(tiny_target, data_dir, tmp_path):
    """make_batch labels such a position with the candidate's column (the subset's size), others as
    before; the loss's agreement then counts a draft that drafts the candidate there as right,
    which it does not without; the recipe needs --copy-token and refuses what it cannot mix with."""
    from specdec.training.eagle import CachedSequence, unrolled_loss

    subset = torch.arange(0, 96, 2)
    to_subset = torch.full((96,), -1, dtype=torch.long)
    to_subset[subset] = torch.arange(48)
    ids = [7, 9, 11, 7, 9, 11, 7, 9, 11, 7]
    feats = tiny_target.forward(tiny_target.new_cache(1), torch.tensor([ids]), want_hidden=True).hidden
    top1 = torch.tensor(ids[1:])  # the target's top-1 after each position: here the sequence itself
    seq = CachedSequence(features=feats[0, :9].half(), tokens=torch.tensor(ids[1:]).int(), top1=top1.int(),
                         eval_from=0, first=ids[0])
    plain, copied = make_batch([seq], to_subset), make_batch([seq], to_subset, copy_labels=True)
    assert (plain.labels[0] == -1).all()  # every label odd: outside the subset
    # pair j's candidate (for t_{j+2}) is known from j = 2 on (7 9 11 7 -> 9), the label there is it
    assert copied.labels[0, :8].tolist() == [-1, -1, 48, 48, 48, 48, 48, 48]
    draft = loud_copy_draft(tiny_target, subset)
    recipe = replace(RECIPE, previous_token=True, copy_token=True)
    with torch.no_grad():
        right = unrolled_loss(draft, copied, replace(recipe, copy_labels=True))[1][0]
        none = unrolled_loss(draft, plain, recipe)[1][0]
    assert right[0] >= 5 and none[0] == 0, (right, none)
    for bad in (replace(RECIPE, copy_labels=True), replace(recipe, copy_labels=True, soft_labels=True)):
        with pytest.raises(InvalidRequest, match="--copy-labels"):
            train_eagle(tiny_target, [data_dir], tmp_path / "e", tmp_path / "w", recipe=bad, max_steps=1)
    train_eagle(tiny_target, [data_dir], tmp_path / "ok", tmp_path / "wok", recipe=replace(recipe, copy_labels=True),
                max_steps=2, log=lambda _: None)
    assert json.loads((tmp_path / "ok" / "eagle_vocab.json").read_text())["recipe"]["copy_labels"]
    assert load_eagle(tmp_path / "ok", tiny_target).copy_token
