"""EAGLE draft training on a frozen target, from self-distilled data (the target's own answers).

Recipe (`EagleRecipe`; the draft itself: specdec.eagle):
1. Teacher: the target (backend fast, float32) reads each sequence (prompt + answer, its last
   `max_seq` tokens) once; its features (last hidden states after the final norm) and its top-1
   token at every position are cached in float16 shards under the work folder (Medusa's
   `HiddenCache`, keyed by a hash of the token ids, so more data later costs only the new
   sequences). Row j of a sequence is the pair (f_j, t_{j+1}) with the target's top-1 y_j.
   Sequences are taken in a seeded shuffled order, so a partial pass (the pass gets at most
   `teacher_share` of the time budget left) samples every data folder; uncached sequences are
   not trained on.
2. Draft: fc + one Llama decoder layer, output layer = the target's (frozen) rows of the `vocab`
   most frequent answer tokens (+ EOS), chosen once per run and kept across resumes. With
   `previous_token` each pair reads the token before its own too (specdec.eagle); a run with it
   warm-started from the directory of a run without it widens that draft (`widen_fc`) and goes on.
   With `tap_layers` each pair reads the target's residuals after those layers too: a second
   cache (<work>/taps-<max_seq>-<layers>/, the decoder run only as deep as the deepest layer)
   holds them for the sequences with features, those cached by earlier runs first; a run with
   them trains on the sequences that have both. `--init` from a draft without them widens it.
   With `copy_token` each pair reads its copy candidate (specdec.copy_tokens, computed per batch
   from the sequence's tokens, at every unrolled step: on the path the target accepts the
   drafted tokens are the true ones); `--init` from a draft without it widens it. With
   `copy_labels` too, a label outside the subset that is its pair's candidate counts, against the
   candidate's logit beside the subset's (what drafting drafts: EagleDraft.copy_logits).
3. Loss at pair j: SmoothL1 between the predicted f^_{j+1} and the target's f_{j+1}
   (`feature_weight`, EAGLE's 1.0) + cross-entropy of the subset logits against the target's
   top-1 y_{j+1} (`token_weight`, EAGLE's 0.1; tokens outside the subset carry no token loss).
   Unrolled `unroll` steps: step s > 0 feeds at position j the feature step s - 1 predicted
   there, not the true one, and attends to the true pairs up to j - s and to the chain of
   predicted pairs of steps 1..s-1 before it (`unroll_mask`): what the draft sees at drafting
   depth s + 1 (EAGLE-3's training-time test); step s weighs `step_decay ** s`.
4. AdamW, warm-up then cosine decay (to 10%) over the step or time budget, gradient clipping.
   Every `heldout_every`-th sequence (by key) is held out: top-1 agreement with the target per
   drafting depth, on the positions that predict answer tokens, at every checkpoint.
5. Checkpoints (weights, optimizer, step, RNG, elapsed minutes, vocabulary) every few minutes in
   <work>/checkpoint.pt; `resume` continues. The output directory (and its RECIPE.md: the command,
   data, tokens seen, minutes) is rewritten at every checkpoint, so an interrupted run leaves a
   usable draft. When the work folder is gone (a new machine) but the output directory is there,
   `resume` warm-starts from it: its weights, step and minutes, a fresh optimizer with a new
   warm-up, and the teacher starts where the earlier runs' teacher passes stopped in the seeded
   order (new sequences first).

Limitation: the gradient flows through the unrolled predictions; training is on the CPU
(or wherever the target is) in float32.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tqdm import tqdm

from specdec.copy_tokens import NONE, copy_candidates
from specdec.eagle import (VOCAB_FILE, WEIGHTS_FILE, EagleDraft, build_eagle, fc_inputs, is_eagle_dir, save_eagle,
                           widen_fc)
from specdec.errors import InvalidRequest
from specdec.backends.hf import CausalLM
from specdec.training.medusa import Example, HiddenCache, build_hidden_cache, fill_cache, frequent_tokens
from specdec.training.progress import TrainState
from specdec.training.selfdistill import read_parts


@dataclass(frozen=True)
class EagleRecipe:
    vocab: int = 8192  # draftable tokens: the most frequent answer tokens (+ EOS), as the shipped draft
    lr: float = 3e-4
    warmup_steps: int = 50
    tokens_per_step: int = 2048  # pairs per optimizer step (sequences packed until reached)
    max_seq: int = 768  # longer sequences keep their last max_seq tokens
    unroll: int = 3  # training steps per batch: the teacher-forced one + 2 on the draft's own features
    feature_weight: float = 1.0  # EAGLE's regression weight
    token_weight: float = 0.1  # EAGLE's classification weight
    step_decay: float = 0.8  # loss weight of unroll step s: step_decay ** s
    heldout_every: int = 20  # sequences whose key is 0 modulo this are held out
    seed: int = 0
    previous_token: bool = False  # pairs read the token before theirs too (specdec.eagle: copying in one layer)
    soft_labels: bool = False  # token loss against the target's distribution over the subset, not its top-1
    context_vocab: bool = False  # the context's tokens are draftable too (specdec.eagle: copying rare tokens)
    tap_layers: tuple[int, ...] = ()  # pairs read these target layers' residuals too (specdec.eagle; EAGLE-3's fusion)
    copy_token: bool = False  # pairs read their copy candidate too (specdec.copy_tokens: what prompt lookup drafts)
    # the token loss counts a label outside the subset where it is the pair's copy candidate (which a
    # copy_token draft drafts beside its subset, scored by the target's output row)
    copy_labels: bool = False


def same_recipe(saved: dict, recipe: EagleRecipe) -> bool:
    """Whether a recipe stored by a run (its dict; keys added since take their old meaning)
    is `recipe`."""
    full = {"previous_token": False, "soft_labels": False, "context_vocab": False, "tap_layers": (),
            "copy_token": False, "copy_labels": False, **saved}
    return {**full, "tap_layers": tuple(full["tap_layers"])} == asdict(recipe)  # (JSON keeps a list)


def widens(saved: dict, recipe: EagleRecipe) -> bool:
    """Whether `recipe` is the stored one but for previous_token, which it adds (specdec.eagle.widen_fc)."""
    return recipe.previous_token and same_recipe({**saved, "previous_token": True}, recipe) \
        and not saved.get("previous_token", False)


@dataclass
class EagleState(TrainState):
    """tokens_seen: training pairs at depth 1; elapsed_s: teacher pass + training."""

    teacher_s: float = 0.0  # of which the teacher pass
    teacher_sequences: int = 0  # sequences whose features the teacher computed, over all runs
    # history: [(tokens seen, held-out top-1 agreement per drafting depth, held-out loss, held-out sequences)]
    # (entries written before the held-out count was recorded have 3 items)


@dataclass(frozen=True)
class CachedSequence:
    """One cached sequence: rows j = pairs (f_j, t_{j+1}) with the target's top-1 y_j."""

    features: torch.Tensor  # [m, H] float16
    tokens: torch.Tensor  # [m] int32: t_{j+1}
    top1: torch.Tensor  # [m] int32: y_j
    eval_from: int  # first row whose depth-1 prediction (t_{j+2}) is an answer token
    first: int = 0  # t_0, the token before row 0's t_1
    taps: Optional[torch.Tensor] = None  # [m, n * H] float16: the target's residuals after the recipe's tap_layers


@dataclass(frozen=True)
class Batch:
    features: torch.Tensor  # [B, W, H] float32, rows right-padded
    tokens: torch.Tensor  # [B, W] long
    previous: torch.Tensor  # [B, W] long: t_j, the token before the pair's
    valid: torch.Tensor  # [B, W] bool: a real pair
    # labels: index of y_{j+1} in vocab_ids (without them: in the subset); -1 where it is not draftable
    # there (outside the subset, and for a context batch not among t_0..t_{j+1}) or past the end
    labels: torch.Tensor  # [B, W] long
    has_target: torch.Tensor  # [B, W] bool: pair j has a next row (j + 1 < m)
    judged: torch.Tensor  # [B, W] bool: has_target and predicts an answer token (agreement)
    vocab_ids: Optional[torch.Tensor] = None  # [E] long: a context batch's draftable tokens, the subset's first
    taps: Optional[torch.Tensor] = None  # [B, W, n * H] float32, where the sequences have them
    # copies: pair j's copy candidate (for t_{j+2}, from t_0..t_{j+1}; specdec.copy_tokens), -1 none or padding
    copies: Optional[torch.Tensor] = None  # [B, W] long


# --- data -------------------------------------------------------------------------------------

def load_examples(data_dirs: Sequence[Path]) -> tuple[list[Example], dict[str, int]]:
    """Rows with an answer from the self-distilled parts of each folder, deduplicated, and how
    many each folder holds."""
    found, counts = {}, {}
    for d in data_dirs:
        counts[str(d)] = 0
        for row in read_parts(d):
            if row["answer_ids"]:
                ex = Example(tuple(row["prompt_ids"]), tuple(row["answer_ids"]), row.get("category", ""))
                found.setdefault(ex.key, ex)
                counts[str(d)] += 1
    return list(found.values()), counts


def is_heldout(key: str, every: int) -> bool:
    return int(key[:8], 16) % every == 0


def first_token(ex: Example, max_seq: int) -> int:
    """t_0 of the cached sequence (the teacher reads the last max_seq tokens)."""
    ids = list(ex.prompt_ids) + list(ex.answer_ids)
    return ids[max(0, len(ids) - max_seq)]


def answer_row(ex: Example, max_seq: int) -> int:
    """First cached row j whose depth-1 prediction t_{j+2} is an answer token (after the cut)."""
    cut = max(0, len(ex.prompt_ids) + len(ex.answer_ids) - max_seq)
    return max(0, len(ex.prompt_ids) - cut - 2)


def first_positions(ids: Sequence[int]) -> dict[int, int]:
    """Each token of ids -> the position it first holds."""
    first: dict[int, int] = {}
    for pos, t in enumerate(ids):
        first.setdefault(t, pos)
    return first


def context_labels(seq: CachedSequence, to_vocab: torch.Tensor, subset: int) -> torch.Tensor:
    """For each row j < m - 1, y_{j+1}'s index in to_vocab [vocab] where the subset drafts it (the
    indices below `subset`) or the row's context t_0..t_{j+1} holds it (what a context_vocab draft
    may draft there), else -1."""
    ids = [seq.first] + seq.tokens.tolist()  # t_0..t_m
    first_seen = first_positions(ids)
    labels = seq.top1[1:].long()  # y_{j+1}, j = 0..m-2
    seen_at = torch.tensor([first_seen.get(t, len(ids)) for t in labels.tolist()], dtype=torch.long)
    index = to_vocab[labels]
    draftable = ((index >= 0) & (index < subset)) | (seen_at <= torch.arange(len(labels)) + 1)
    return torch.where(draftable, index, -1)


def make_batch(seqs: Sequence[CachedSequence], to_subset: torch.Tensor, context_vocab: bool = False,
               copy_labels: bool = False) -> Batch:
    """Cached sequences -> one right-padded batch (to_subset [vocab]: subset index or -1).
    context_vocab: the batch's draftable tokens are the subset's and every token its sequences
    hold (vocab_ids), a label counting where the subset drafts it or its row's context holds it.
    copy_labels: a label outside the subset that is its pair's copy candidate is the subset's
    size (the column of the candidate's logit, beside the subset's)."""
    width = max(len(s.tokens) for s in seqs)
    hidden = seqs[0].features.shape[1]
    vocab_ids = None
    if context_vocab:  # the subset's tokens, then the others the batch holds
        subset_ids = torch.nonzero(to_subset >= 0).flatten()[to_subset[to_subset >= 0].argsort()]
        held = torch.unique(torch.cat([torch.cat([torch.tensor([s.first]), s.tokens.long()]) for s in seqs]))
        vocab_ids = torch.cat([subset_ids, held[to_subset[held] < 0]])
        to_vocab = torch.full_like(to_subset, -1)
        to_vocab[vocab_ids] = torch.arange(len(vocab_ids))
    feats = torch.zeros(len(seqs), width, hidden)
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    previous = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), -1, dtype=torch.long)
    valid = torch.zeros(len(seqs), width, dtype=torch.bool)
    has_target = torch.zeros(len(seqs), width, dtype=torch.bool)
    judged = torch.zeros(len(seqs), width, dtype=torch.bool)
    taps = None if seqs[0].taps is None else torch.zeros(len(seqs), width, seqs[0].taps.shape[1])
    copies = torch.full((len(seqs), width), NONE, dtype=torch.long)
    for b, s in enumerate(seqs):
        m = len(s.tokens)
        feats[b, :m] = s.features.float()
        if taps is not None:
            taps[b, :m] = s.taps.float()
        tokens[b, :m] = s.tokens.long()
        previous[b, 0] = s.first
        previous[b, 1:m] = s.tokens[: m - 1].long()
        labels[b, : m - 1] = (context_labels(s, to_vocab, len(subset_ids)) if context_vocab
                              else to_subset[s.top1[1:].long()])
        valid[b, :m] = True
        copies[b, :m] = torch.tensor(copy_candidates([s.first, *s.tokens.tolist()])[1:], dtype=torch.long)
        if copy_labels:
            copied = (labels[b, : m - 1] < 0) & (s.top1[1:].long() == copies[b, : m - 1])
            labels[b, : m - 1][copied] = int((to_subset >= 0).sum())
        has_target[b, : m - 1] = True
        judged[b, s.eval_from : m - 1] = True
    return Batch(feats, tokens, previous, valid, labels, has_target, judged, vocab_ids, taps, copies)


# --- the unrolled loss ------------------------------------------------------------------------

def unroll_mask(valid: torch.Tensor, step: int) -> torch.Tensor:
    """Who each input of unroll step `step` attends to. valid [B, W] -> allowed [B, W, (step + 1) * W]
    over the keys of steps 0..step (in that order). Step 0 is causal over the true pairs; at
    step s > 0 the input at j (the pair at drafting depth s + 1 after the true pairs up to
    j - s) attends to the true pairs up to j - s, to step s' 's input at j - s + s' for
    s' = 1..s-1 (the chain drafted before it) and to itself."""
    width = valid.shape[1]
    q = torch.arange(width)[:, None]  # [W, 1] query positions
    k = torch.arange(width)[None, :]  # [1, W] key positions
    blocks = [k <= q - step] + [k == q - step + s for s in range(1, step + 1)]  # each [W, W]
    allowed = torch.cat(blocks, dim=1)[None] & valid.repeat(1, step + 1)[:, None, :]  # [B, W, (step+1) W]
    allowed[:, :, step * width :] |= torch.eye(width, dtype=torch.bool)  # every input sees itself
    return allowed


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [B, q, kv] -> additive mask [B, 1, q, kv]."""
    mask = torch.zeros(allowed.shape, dtype=dtype)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def unrolled_outputs(draft: EagleDraft, features: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor,
                     unroll: int, previous: Optional[torch.Tensor] = None,
                     taps: Optional[torch.Tensor] = None, copies: Optional[torch.Tensor] = None
                     ) -> list[torch.Tensor]:
    """The draft's predicted features at every unroll step: features [B, W, H] (true f_j),
    tokens [B, W] (t_{j+1}), valid [B, W], previous [B, W] (t_j; read by a previous_token
    draft), taps [B, W, n * H] (the target's residuals at j; read by a tap_layers draft at
    step 0 only: a drafted pair has none), copies [B, W] (pair j's copy candidate from
    t_0..t_{j+1}; read by a copy_token draft at every step: on the path the target accepts the
    drafted tokens are the true ones) -> [out_0, ..., out_{unroll-1}], each [B, W, H]; out_s
    at j is the draft's f^_{j+1} at drafting depth s + 1 (its input at j: f_j for s = 0, else
    out_{s-1} at j - 1; undefined for j < s)."""
    from transformers import DynamicCache

    width = features.shape[1]
    positions = torch.arange(width).expand(features.shape[0], width)  # [B, W]
    cache = DynamicCache()  # keys and values of every step, in order (what unroll_mask indexes)
    inputs, outs = features, []
    for s in range(unroll):
        outs.append(draft(inputs, tokens, additive(unroll_mask(valid, s), draft.dtype), positions, cache,
                          previous_ids=previous, taps=taps if s == 0 else None, copy_ids=copies))
        inputs = torch.cat([torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]], dim=1)  # step s+1 reads f^_j at j
    return outs


def teacher_probs(draft: EagleDraft, features: torch.Tensor) -> torch.Tensor:
    """The target's next-token distribution restricted to the draft's subset (renormalized), from
    its features [N, H] through its own output rows: [N, subset]. The features are the target's
    after its final norm, so these are its logits over the subset exactly (up to float16 caching)."""
    return torch.softmax(draft.subset_logits(features.float()), dim=-1)


def unrolled_loss(draft: EagleDraft, batch: Batch, recipe: EagleRecipe
                  ) -> tuple[torch.Tensor, list[tuple[int, int]], int]:
    """-> (weighted loss, [(agreeing, judged) positions per drafting depth], pairs with a target)."""
    feats, width = batch.features, batch.features.shape[1]
    target = torch.cat([feats[:, 1:], torch.zeros_like(feats[:, :1])], dim=1)  # [B, W, H]: f_{j+1} at j
    total, agreement = feats.new_zeros(()), []
    outs = unrolled_outputs(draft, feats, batch.tokens, batch.valid, recipe.unroll, batch.previous, batch.taps,
                            batch.copies)
    for s, out in enumerate(outs):
        use = batch.has_target & (torch.arange(width) >= s)[None]  # [B, W]; step s has inputs from j = s
        pred, labels = out[use], batch.labels[use]  # [N, H], [N]
        logits = draft.subset_logits(pred) if batch.vocab_ids is None else pred @ draft.output[batch.vocab_ids].T
        if recipe.copy_labels:  # the candidate's logit beside the subset's (-inf where none or in the subset)
            logits = torch.cat([logits, draft.copy_logits(pred, batch.copies[use])[1].to(logits.dtype)], dim=-1)
        loss = recipe.feature_weight * F.smooth_l1_loss(pred, target[use])
        if recipe.soft_labels:  # EAGLE's own classification loss: the target's p(t_{j+2}) from f_{j+1}
            loss = loss + recipe.token_weight * F.cross_entropy(logits, teacher_probs(draft, target[use]))
        elif (labels >= 0).any():
            loss = loss + recipe.token_weight * F.cross_entropy(logits, labels, ignore_index=-1)
        total = total + recipe.step_decay ** s * loss
        judged = batch.judged[use]
        agreement.append((int(((logits.argmax(-1) == labels) & judged).sum()), int(judged.sum())))
    return total, agreement, int(batch.has_target.sum())


def lr_at(step: int, progress: float, recipe: EagleRecipe) -> float:
    """Linear warm-up over warmup_steps, then cosine from lr to lr / 10 over progress in [0, 1]."""
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


# --- the run ----------------------------------------------------------------------------------

def recipe_markdown(meta: dict) -> str:
    """RECIPE.md of an EAGLE directory, from its metadata (eagle_vocab.json's, less the ids)."""
    agree = meta["history"][-1][1] if meta["history"] else []
    lines = [f"# EAGLE draft for {meta['target']}", "",
             "Made by `specdec train eagle` (specdec.training.eagle); "
             f"{'final' if meta['final'] else 'checkpoint of a run still going or interrupted'}.", "",
             "    " + (meta.get("command") or "(called from Python: specdec.training.eagle.train_eagle)"), "",
             f"- data: {', '.join(f'{d} ({n} sequences)' for d, n in meta['data'].items())}; teacher features cached "
             f"for {meta['train_sequences']} training and {meta['heldout_sequences']} held-out sequences",
             f"- {meta['steps']} steps, {meta['tokens_seen']:,} training positions seen, "
             f"{meta['train_minutes']} minutes ({meta['teacher_minutes']} of them the teacher pass)",
             "- held-out top-1 agreement with the target by drafting depth: "
             + (", ".join(f"{i + 1}: {a}" for i, a in enumerate(agree)) or "none measured"),
             f"- recipe: {meta['recipe']}"]
    if meta.get("init"):
        lines.append(f"- started from the weights of {meta['init']} (its steps and minutes are not counted here)")
    heldout_sizes = [h[3] if len(h) > 3 else "?" for h in meta["history"]]  # "?": rows from before it was kept
    lines += ["", "History (training positions, agreement by depth, held-out loss, held-out sequences):", ""]
    lines += [f"    {h[0]:>10,}  {h[1]}  {h[2]}  {n}" for h, n in zip(meta["history"], heldout_sizes)]
    if len(set(heldout_sizes)) > 1:
        lines += ["", "The held-out set changed during the run (the data grew between resumed runs, or earlier rows "
                  "did not record its size): rows over different held-out sets do not compare."]
    return "\n".join(lines) + "\n"


def warm_start(out_dir: Path, recipe: EagleRecipe) -> Optional[tuple[EagleState, torch.Tensor, dict]]:
    """(state, vocabulary, float32 weights) of the EAGLE directory an earlier run of this recipe
    wrote, or None where there is none; another recipe's directory is refused."""
    if not is_eagle_dir(out_dir):
        return None
    meta = json.loads((out_dir / VOCAB_FILE).read_text())
    saved = meta.get("recipe") or {}
    if not same_recipe(saved, recipe) and not widens(saved, recipe):
        raise InvalidRequest(f"{out_dir} was made with another recipe: {meta.get('recipe')}; "
                             "choose another --out or the same recipe (or it with --previous-token)")
    state = EagleState(step=meta["steps"], tokens_seen=meta["tokens_seen"], elapsed_s=meta["train_minutes"] * 60,
                       teacher_s=meta["teacher_minutes"] * 60, teacher_sequences=meta.get("teacher_sequences", 0),
                       history=[tuple(h) for h in meta["history"]])
    weights = {k: v.float() for k, v in load_file(str(out_dir / WEIGHTS_FILE)).items()}
    if widens(saved, recipe):
        weights = widen_fc(weights, int(meta["hidden_size"]))
    return state, torch.tensor(meta["token_ids"], dtype=torch.long), weights


def init_weights(init_dir: Path, recipe: EagleRecipe) -> tuple[torch.Tensor, dict]:
    """(vocabulary, float32 weights) of an EAGLE directory to start a run of `recipe` from, whatever
    recipe made it (the loss may differ; the draft's shape may not, but a draft without
    previous_token, or without tap layers, is widened for a recipe with them: it computes the
    same until trained)."""
    if not is_eagle_dir(init_dir):
        raise InvalidRequest(f"--init {init_dir}: not an EAGLE draft directory")
    meta = json.loads((init_dir / VOCAB_FILE).read_text())
    had_previous = bool((meta.get("recipe") or {}).get("previous_token", False))
    if had_previous and not recipe.previous_token:
        raise InvalidRequest(f"--init {init_dir} reads the previous token: train with --previous-token")
    had_taps = tuple(meta.get("tap_layers", ()))
    if had_taps and had_taps != recipe.tap_layers:
        raise InvalidRequest(f"--init {init_dir} reads target layers {list(had_taps)}: train with "
                             f"--tap-layers {','.join(map(str, had_taps))}")
    weights = {k: v.float() for k, v in load_file(str(init_dir / WEIGHTS_FILE)).items()}
    hidden = int(meta["hidden_size"])
    if recipe.previous_token and not had_previous:
        weights = widen_fc(weights, hidden)
    had_copy = bool(meta.get("copy_token", False))
    if had_copy and not recipe.copy_token:
        raise InvalidRequest(f"--init {init_dir} reads each pair's copy candidate: train with --copy-token")
    if had_copy and (recipe.previous_token and not had_previous or recipe.tap_layers and not had_taps):
        raise InvalidRequest(f"--init {init_dir} reads copy candidates: it cannot be widened to read the previous "
                             "token or tap layers too (their columns come before the candidate's)")
    if recipe.tap_layers and not had_taps:
        weights = widen_fc(weights, hidden, fc_inputs(recipe.previous_token, 0),
                           fc_inputs(recipe.previous_token, len(recipe.tap_layers)))
    if recipe.copy_token and not had_copy:
        taps = len(recipe.tap_layers)
        weights = widen_fc(weights, hidden, fc_inputs(recipe.previous_token, taps),
                           fc_inputs(recipe.previous_token, taps, True))
    return torch.tensor(meta["token_ids"], dtype=torch.long), weights


def pair_taps(target: CausalLM, ids: Sequence[int], layers: Sequence[int]) -> torch.Tensor:
    """The target's residuals after `layers` at the pairs of ids (positions 0..n-2), as the caches
    hold them: [n - 1, len(layers) * H] float16."""
    return target.layer_states(torch.tensor([list(ids)]), layers)[0, :-1].to(torch.float16).cpu()


def sequence_taps(target: CausalLM, ex: Example, max_seq: int, layers: Sequence[int]) -> tuple[torch.Tensor]:
    """pair_taps at the rows the teacher caches for ex (its last max_seq tokens), as a cache row."""
    return (pair_taps(target, (list(ex.prompt_ids) + list(ex.answer_ids))[-max_seq:], layers),)


def train_eagle(target: CausalLM, data_dirs: Sequence[Path], out_dir: Path, work_dir: Path, *,
                recipe: EagleRecipe = EagleRecipe(), init: Optional[Path] = None, target_name: Optional[str] = None,
                time_budget_s: Optional[float] = None, max_steps: Optional[int] = None, resume: bool = False,
                checkpoint_every_s: float = 300.0, teacher_share: float = 0.5,
                teacher_time_s: Optional[float] = None, command: Optional[str] = None,
                log: Callable[[str], None] = print) -> EagleState:
    """Train an EAGLE draft for `target` (its features come from this backend) on the folders'
    self-distilled parts; writes out_dir (the draft) and, in work_dir, the teacher cache and
    checkpoint.pt. Stops at max_steps or once time_budget_s (teacher pass included, summed over
    resumed runs) is spent, whichever comes first; the teacher pass gets at most teacher_share
    of the time left (all of the data when there is no time budget), and at most teacher_time_s
    where given. `init`: an EAGLE directory
    whose weights and vocabulary a new run starts from (step 0, its own warm-up and schedule);
    a checkpoint in work_dir, or with `resume` this recipe's draft in out_dir, goes before it."""
    if time_budget_s is None and max_steps is None:
        raise InvalidRequest("give a time budget or a step budget")
    if recipe.soft_labels and recipe.context_vocab:
        raise InvalidRequest("soft labels are the target's distribution over the subset: not with a context vocabulary")
    if recipe.copy_labels and (not recipe.copy_token or recipe.context_vocab or recipe.soft_labels):
        raise InvalidRequest("--copy-labels counts labels that are a pair's copy candidate: it needs --copy-token, "
                             "and not --context-vocab (whose context holds them) or --soft-labels (over the subset)")
    if recipe.tap_layers and not getattr(target, "returns_taps", False):
        raise InvalidRequest(f"--tap-layers reads the target's inner layers: the {target.backend} backend does not "
                             "return them; train on the fast backend")
    layers = int(target.config.num_hidden_layers)
    if any(not 0 <= i < layers for i in recipe.tap_layers):
        raise InvalidRequest(f"--tap-layers {list(recipe.tap_layers)}: the target's decoder layers are 0..{layers - 1}")
    out_dir, work_dir = Path(out_dir), Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    ckpt = work_dir / "checkpoint.pt"
    if ckpt.exists() and not resume:
        raise InvalidRequest(f"{ckpt} exists: pass --resume to continue that run, or choose another --work")
    examples, data_counts = load_examples(data_dirs)
    if not examples:
        raise InvalidRequest(f"no self-distilled data in {', '.join(map(str, data_dirs))}")
    target_name = target_name or target.name
    torch.manual_seed(recipe.seed)
    rng = random.Random(recipe.seed)
    state = EagleState()
    saved = torch.load(ckpt, weights_only=False) if resume and ckpt.exists() else None
    warm = warm_start(out_dir, recipe) if resume and saved is None else None
    if saved is not None:
        if not same_recipe(saved["recipe"], recipe):
            raise InvalidRequest(f"{ckpt} was made with another recipe: {saved['recipe']}")
        state = EagleState(**saved["state"])
        token_ids = saved["token_ids"]
    elif warm is not None:
        state, token_ids, warm_weights = warm
    elif init is not None:
        token_ids, warm_weights = init_weights(Path(init), recipe)
    else:
        token_ids = frequent_tokens(examples, recipe.vocab, target.eos_token_ids)

    # 1. teacher: features and top-1 once per sequence, in a seeded order, within its share of the time.
    t0 = time.monotonic()
    order = list(examples)
    random.Random(recipe.seed).shuffle(order)
    cut = state.teacher_sequences % len(order)
    order = order[cut:] + order[:cut]  # where earlier teacher passes stopped: new sequences first
    left = None if time_budget_s is None else max(0.0, time_budget_s - state.elapsed_s)
    share = None if left is None else left * teacher_share
    if teacher_time_s is not None:
        share = teacher_time_s if share is None else min(share, teacher_time_s)

    def teacher_time() -> Optional[float]:  # of the teacher's share: None (no budget) or what is left
        return None if share is None else max(0.0, share - (time.monotonic() - t0))

    cache = HiddenCache(work_dir / f"teacher-{recipe.max_seq}")
    tap_cache = None if not recipe.tap_layers else HiddenCache(
        work_dir / f"taps-{recipe.max_seq}-{'-'.join(map(str, recipe.tap_layers))}", columns=("taps",))

    def tap_pass() -> None:  # the residuals of the sequences with features
        if tap_cache is not None and teacher_time() != 0.0:
            have = cache.keys()
            fill_cache([ex for ex in order if ex.key in have], tap_cache,
                       lambda ex: sequence_taps(target, ex, recipe.max_seq, recipe.tap_layers),
                       f"target residuals after layers {list(recipe.tap_layers)}", time_budget_s=teacher_time())

    if left is None or left > 0:
        tap_pass()  # first those whose features earlier runs cached
        added = 0 if teacher_time() == 0.0 else build_hidden_cache(
            target, order, cache, recipe.max_seq, include_prompt=True, time_budget_s=teacher_time())
        state.teacher_sequences += added
        if added:
            log(f"teacher: features of {added} new sequences cached")
        tap_pass()
    stored = cache.load([ex.key for ex in order])
    taps: dict = {}
    if tap_cache is not None:  # a tap_layers draft trains on the sequences with both
        taps = {k: t for k, (t,) in tap_cache.load(list(stored)).items()}
        stored = {k: v for k, v in stored.items() if k in taps}
    spent = time.monotonic() - t0
    state.teacher_s += spent
    state.elapsed_s += spent
    seqs = {ex.key: CachedSequence(*stored[ex.key], eval_from=answer_row(ex, recipe.max_seq),
                                   first=first_token(ex, recipe.max_seq), taps=taps.get(ex.key))
            for ex in order if ex.key in stored and len(stored[ex.key][1]) >= 2}
    train = [s for k, s in seqs.items() if not is_heldout(k, recipe.heldout_every)]
    heldout = [s for k, s in seqs.items() if is_heldout(k, recipe.heldout_every)]
    if not train:
        raise InvalidRequest("no training sequence has teacher features yet: give the run more time")
    to_subset = torch.full((target.vocab_size,), -1, dtype=torch.long)
    to_subset[token_ids] = torch.arange(len(token_ids))
    log(f"eagle: {len(train)} training and {len(heldout)} held-out sequences with features (of {len(examples)}); "
        f"draftable vocabulary {len(token_ids)}")

    # 2. the draft, the optimizer, the checkpoint.
    draft = build_eagle(target, token_ids, previous_token=recipe.previous_token, context_vocab=recipe.context_vocab,
                        tap_layers=recipe.tap_layers, copy_token=recipe.copy_token).float().train()
    opt = torch.optim.AdamW(draft.parameters(), lr=recipe.lr, weight_decay=0.0)
    if saved is not None:
        draft.load_state_dict(saved["draft"])
        opt.load_state_dict(saved["optimizer"])
        rng.setstate(saved["rng"])
        torch.set_rng_state(saved["torch_rng"])
        log(f"resumed at step {state.step} ({state.tokens_seen} positions, {state.elapsed_s / 60:.1f} min)")
    elif warm is not None:
        draft.load_state_dict(warm_weights)
        log(f"warm start from {out_dir} at step {state.step} ({state.tokens_seen} positions, "
            f"{state.elapsed_s / 60:.1f} min): fresh optimizer, new warm-up")
    elif init is not None:
        draft.load_state_dict(warm_weights)
        log(f"started from the weights of {init}")
    rewarm_from = state.step if warm is not None else 0
    # the directory the run's first weights came from: kept across resumes (in the checkpoint and the meta)
    if saved is not None:
        meta_init = saved.get("init")
    elif warm is not None:
        meta_init = json.loads((out_dir / VOCAB_FILE).read_text()).get("init")
    else:
        meta_init = None if init is None else str(init)

    def progress() -> float:
        by_steps = state.step / max_steps if max_steps else 0.0
        by_time = state.elapsed_s / time_budget_s if time_budget_s else 0.0
        return max(by_steps, by_time)

    def evaluate() -> tuple[int, list[float], float, int]:
        draft.eval()
        hits = [[0, 0] for _ in range(recipe.unroll)]
        loss_sum, count = 0.0, 0
        with torch.no_grad():
            for i in range(0, len(heldout), 8):
                batch = make_batch(heldout[i : i + 8], to_subset, recipe.context_vocab, recipe.copy_labels)
                loss, agreement, n = unrolled_loss(draft, batch, recipe)
                loss_sum, count = loss_sum + float(loss) * n, count + n
                for h, (a, j) in zip(hits, agreement):
                    h[0], h[1] = h[0] + a, h[1] + j
        draft.train()
        return (state.tokens_seen, [round(a / max(j, 1), 4) for a, j in hits], round(loss_sum / max(count, 1), 4),
                len(heldout))

    def checkpoint(final: bool) -> None:
        tmp = work_dir / "checkpoint.pt.tmp"
        torch.save({"draft": draft.state_dict(), "optimizer": opt.state_dict(), "state": asdict(state),
                    "rng": rng.getstate(), "torch_rng": torch.get_rng_state(), "token_ids": token_ids,
                    "recipe": asdict(recipe), "init": meta_init}, tmp)
        tmp.replace(ckpt)
        meta = {"target": target_name, "recipe": asdict(recipe), "command": command, "data": data_counts,
                "init": meta_init,
                "train_sequences": len(train), "heldout_sequences": len(heldout), "steps": state.step,
                "tokens_seen": state.tokens_seen, "train_minutes": round(state.elapsed_s / 60, 1),
                "teacher_minutes": round(state.teacher_s / 60, 1), "teacher_sequences": state.teacher_sequences,
                "history": state.history, "final": final}
        save_eagle(out_dir, draft, meta)
        (out_dir / "RECIPE.md").write_text(recipe_markdown(meta))

    # 3. train.
    start, last_ckpt = time.monotonic() - state.elapsed_s, time.monotonic()
    bar = tqdm(total=max_steps, initial=state.step, desc="eagle", unit="step", dynamic_ncols=True)
    while (max_steps is None or state.step < max_steps) and (time_budget_s is None or state.elapsed_s < time_budget_s):
        batch, pairs = [], 0
        while pairs < recipe.tokens_per_step:
            s = train[rng.randrange(len(train))]
            batch.append(s)
            pairs += len(s.tokens) - 1
        for g in opt.param_groups:
            g["lr"] = lr_at(state.step - rewarm_from, progress(), recipe)
        loss, agreement, n = unrolled_loss(draft, make_batch(batch, to_subset, recipe.context_vocab, recipe.copy_labels), recipe)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        state.step += 1
        state.tokens_seen += n
        state.elapsed_s = time.monotonic() - start
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", agree="/".join(f"{a / max(j, 1):.2f}" for a, j in agreement),
                        min=f"{state.elapsed_s / 60:.1f}")
        if time.monotonic() - last_ckpt > checkpoint_every_s:
            state.history.append(evaluate())
            checkpoint(final=False)
            last_ckpt = time.monotonic()
    bar.close()
    state.elapsed_s = time.monotonic() - start
    state.history.append(evaluate())
    checkpoint(final=True)
    log(f"eagle: {state.step} steps, {state.tokens_seen} positions, {state.elapsed_s / 60:.1f} min "
        f"({state.teacher_s / 60:.1f} teacher); held-out top-1 agreement by depth {state.history[-1][1]}, "
        f"loss {state.history[-1][2]}; written to {out_dir}")
    return state
