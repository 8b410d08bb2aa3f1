"""Draft distillation: a few of the target's own layers, trained to match the target's
next-token distribution on the target's own answers (self-distilled data).

Recipe (chosen by measurement, see the README's draft section):
1. Draft = the target's embeddings (frozen, shared at load time) + copies of `layers` target
   decoder layers + the target's final norm; output layer = the tied embedding rows of the
   `vocab` most frequent tokens of the training answers (FR-Spec: a reduced draft vocabulary
   cuts the draft's largest matmul; tokens outside it are simply never drafted).
2. Teacher: the target's top-`topk` logits at every position (answers, and prompts too by
   default: the target's distribution over any text it reads is signal), computed once and cached
   (so training never runs the target again), renormalised over those top-k tokens.
3. Loss: cross-entropy of the draft's subset distribution against the teacher's top-k
   distribution (forward KL up to a constant). AdamW, cosine decay, gradient clipping.
4. Checkpoints every few minutes (weights, optimiser, step, RNG); `--resume` continues; the
   output directory is rewritten at every checkpoint, so an interrupted run still leaves a
   usable draft.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

from specdec.drafts import build_from_target, save_draft
from specdec.backends.hf import CausalLM
from specdec.training.progress import TrainState
from specdec.training.selfdistill import read_parts


@dataclass(frozen=True)
class DraftRecipe:
    layers: tuple[int, ...] = (0, 10, 20, 29)  # target layers copied into the draft, in order
    vocab: int = 8192  # draft output vocabulary: most frequent answer tokens (+ EOS)
    topk: int = 32  # teacher logits kept per position
    lr: float = 3e-4
    warmup_steps: int = 50
    tokens_per_step: int = 2048  # answer tokens per optimiser step (packed sequences)
    max_seq: int = 768  # longer sequences keep their last max_seq tokens
    heldout_every: int = 20  # every n-th sequence is held out for the agreement metric
    # Also learn the target's distribution over the prompt tokens, not just its answers: the teacher
    # is the target reading any text, so prompts triple the training positions for free.
    prompt_positions: bool = True
    seed: int = 0


# TrainState.history here: [(tokens_seen, held-out top-1 agreement with the target on answer tokens, loss)]


# --- data -------------------------------------------------------------------------------------

def load_sequences(data_dirs: list[Path]) -> list[dict]:
    seqs = []
    for d in data_dirs:
        for row in read_parts(d):
            if row["answer_ids"]:
                seqs.append(row)
    return seqs


def frequent_tokens(seqs: list[dict], size: int, always: tuple[int, ...]) -> torch.Tensor:
    counts: dict[int, int] = {}
    for s in seqs:
        for t in s["answer_ids"]:
            counts[t] = counts.get(t, 0) + 1
    ranked = [t for t, _ in sorted(counts.items(), key=lambda kv: -kv[1])]
    chosen = list(dict.fromkeys(list(always) + ranked))[:size]
    return torch.tensor(sorted(chosen), dtype=torch.long)


@torch.inference_mode()
def teacher_topk(target: CausalLM, seq: list[int], answer_start: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits at the positions that predict answer tokens: -> (ids [n, topk], logits [n, topk])."""
    logits = target.forward(target.new_cache(1), torch.tensor([seq])).logits[0, answer_start - 1 : -1]  # [n, vocab]
    top = torch.topk(logits.float(), topk, dim=-1)
    return top.indices.to(torch.int32), top.values.to(torch.float16)


def build_teacher_cache(target: CausalLM, seqs: list[dict], cache_path: Path, recipe: DraftRecipe,
                        time_budget_s: Optional[float] = None) -> list[dict]:
    """Teacher top-k per sequence, cached on disk by data index; computes only what is missing."""
    cache: dict[int, dict] = torch.load(cache_path) if cache_path.exists() else {}
    t0, last_save = time.monotonic(), time.monotonic()
    todo = [s for s in seqs if s["index_key"] not in cache]
    for s in tqdm(todo, desc="teacher top-k", unit="seq", disable=not todo):
        ids, start = s["ids"], s["answer_start"]
        top_ids, top_logits = teacher_topk(target, ids, start, recipe.topk)
        cache[s["index_key"]] = {"top_ids": top_ids, "top_logits": top_logits}
        if time.monotonic() - last_save > 120:
            torch.save(cache, cache_path)
            last_save = time.monotonic()
        if time_budget_s is not None and time.monotonic() - t0 > time_budget_s:
            break
    torch.save(cache, cache_path)
    return [dict(s, **cache[s["index_key"]]) for s in seqs if s["index_key"] in cache]


def _init_state(path: Path, target: CausalLM, recipe: DraftRecipe) -> tuple[dict, torch.Tensor]:
    """A draft directory's own weights (layers, final norm) and token subset, checked against the
    target and the recipe."""
    from safetensors.torch import load_file

    from specdec.drafts import is_draft_dir

    path = Path(path)
    if not is_draft_dir(path):
        raise ValueError(f"{path} is not a specdec draft directory (draft_vocab.json + draft.safetensors)")
    info = json.loads((path / "draft_vocab.json").read_text())
    if info["vocab_size"] != target.vocab_size:
        raise ValueError(f"draft {path} has a {info['vocab_size']}-token vocabulary, the target {target.vocab_size}")
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    if layers != len(recipe.layers):
        raise ValueError(f"draft {path} has {layers} layers, the recipe {len(recipe.layers)} (--layers)")
    state = {k: v.to(target.dtype) for k, v in load_file(str(path / "draft.safetensors")).items()}
    return state, torch.tensor(info["token_ids"])


def prepare(rows: list[dict], recipe: DraftRecipe) -> list[dict]:
    out = []
    for r in rows:
        ids = list(r["prompt_ids"]) + list(r["answer_ids"])
        start = len(r["prompt_ids"])
        cut = max(0, len(ids) - recipe.max_seq)
        first = 1 if recipe.prompt_positions else max(1, start - cut)
        # answer_start: first position with a loss; eval_start: first answer position (agreement is
        # measured on answers only: prompts carry the chat template's fixed system text, which any
        # draft learns at once and which would flatter the figure).
        out.append({"index_key": f"{r['source']}:{r['index']}:{int(r['sampled'])}:{first}", "category": r["category"],
                    "ids": ids[cut:], "answer_start": first, "eval_start": max(1, start - cut)})
    return out


# --- training ---------------------------------------------------------------------------------

def _batch_loss(model, head_ids: torch.Tensor, to_subset: torch.Tensor, batch: list[dict]):
    """Mean soft cross-entropy over the loss positions of a padded batch, and top-1 agreement with
    the target over its answer positions: (loss, agreeing positions, answer positions, loss positions)."""
    width = max(len(s["ids"]) for s in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    attn = torch.zeros(len(batch), width, dtype=torch.long)
    for b, s in enumerate(batch):
        ids[b, : len(s["ids"])] = torch.tensor(s["ids"])
        attn[b, : len(s["ids"])] = 1
    hidden = model.get_decoder()(input_ids=ids, attention_mask=attn).last_hidden_state  # [batch, width, hidden]
    head = model.get_output_embeddings().weight[head_ids]  # [subset, hidden], frozen
    total, agree, count, judged = 0.0, 0, 0, 0
    for b, s in enumerate(batch):
        start, n = s["answer_start"], len(s["ids"])
        logq = torch.log_softmax(hidden[b, start - 1 : n - 1] @ head.T, dim=-1)  # [m, subset]
        top_sub = to_subset[s["top_ids"].long()]  # [m, topk]; -1 where outside the subset
        inside = top_sub >= 0
        teacher = torch.softmax(s["top_logits"].float().masked_fill(~inside, float("-inf")), dim=-1)  # [m, topk]
        teacher = torch.nan_to_num(teacher)  # rows whose whole top-k is outside the subset carry no signal
        total = total - (teacher * logq.gather(1, top_sub.clamp_min(0))).sum()
        ans = max(0, s.get("eval_start", start) - start)  # first answer row of logq
        agree += int((head_ids[logq[ans:].argmax(-1)] == s["top_ids"][ans:, 0].long()).sum())
        judged += logq.shape[0] - ans
        count += logq.shape[0]
    return total / max(count, 1), agree, judged, count


def train_draft(target: CausalLM, data_dirs: list[Path], out_dir: Path, work_dir: Path, *,
                recipe: DraftRecipe = DraftRecipe(), target_name: str = "target",
                time_budget_s: Optional[float] = None, max_steps: Optional[int] = None,
                resume: bool = False, checkpoint_every_s: float = 300.0,
                init_from: Optional[Path] = None) -> TrainState:
    """init_from: a draft directory whose layers and token subset the run starts from (a draft
    retrained on new data; its layer count must be the recipe's), instead of copies of the
    target's layers and the data's frequent tokens. A checkpoint to resume wins over it."""
    work_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(recipe.seed)
    torch.manual_seed(recipe.seed)
    rows = [dict(r, source=Path(d).name) for d in data_dirs for r in read_parts(d) if r["answer_ids"]]
    if not rows:
        raise ValueError(f"no training data in {', '.join(map(str, data_dirs))}")
    seqs = prepare(rows, recipe)
    init = _init_state(init_from, target, recipe) if init_from is not None else None
    head_ids = init[1] if init is not None else frequent_tokens(rows, recipe.vocab, target.eos_token_ids)
    to_subset = torch.full((target.vocab_size,), -1, dtype=torch.long)
    to_subset[head_ids] = torch.arange(len(head_ids))
    seqs = build_teacher_cache(target, seqs, work_dir / "teacher.pt", recipe)
    heldout = [s for i, s in enumerate(seqs) if i % recipe.heldout_every == 0]
    train = [s for i, s in enumerate(seqs) if i % recipe.heldout_every != 0]

    model = build_from_target(target, list(recipe.layers))
    if init is not None:
        model.load_state_dict(init[0], strict=False)  # its layers and norm; embeddings and head stay the target's
    model.get_input_embeddings().weight.requires_grad_(False)  # the target's, frozen
    model.get_output_embeddings().weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)
    state = TrainState()
    ckpt = work_dir / "checkpoint.pt"
    if resume and ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"], strict=False)
        opt.load_state_dict(saved["optimizer"])
        state = TrainState(**saved["state"])
        rng.setstate(saved["rng"])
        print(f"resumed at step {state.step} ({state.tokens_seen} tokens, {state.elapsed_s / 60:.1f} min)")
    total_steps = max_steps or max(state.step + 1, int(state.step + (time_budget_s or 3600) / 3.0))

    def lr_at(step: int) -> float:
        if step < recipe.warmup_steps:
            return recipe.lr * (step + 1) / recipe.warmup_steps
        return recipe.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, step / total_steps)))

    def evaluate() -> tuple[int, float, float]:
        """-> (tokens seen, held-out top-1 agreement with the target, held-out loss)."""
        model.eval()
        with torch.no_grad():
            agree = judged = count = 0
            loss = 0.0
            for i in range(0, len(heldout), 8):
                l, a, j, c = _batch_loss(model, head_ids, to_subset, heldout[i : i + 8])
                agree, judged, count, loss = agree + a, judged + j, count + c, loss + float(l) * c
        model.train()
        return state.tokens_seen, round(agree / max(judged, 1), 4), round(loss / max(count, 1), 4)

    def checkpoint() -> None:
        torch.save({"model": {k: v for k, v in model.state_dict().items() if "embed" not in k and "lm_head" not in k},
                    "optimizer": opt.state_dict(), "state": asdict(state), "rng": rng.getstate()}, ckpt)
        save_draft(out_dir, model, head_ids, {"target": target_name, "recipe": asdict(recipe),
                                              "steps": state.step, "tokens_seen": state.tokens_seen,
                                              "train_minutes": round(state.elapsed_s / 60, 1),
                                              "history": state.history})

    model.train()
    t0, last_ckpt = time.monotonic() - state.elapsed_s, time.monotonic()
    bar = tqdm(total=max_steps, initial=state.step, desc="draft", unit="step")
    while True:
        state.elapsed_s = time.monotonic() - t0
        if max_steps is not None and state.step >= max_steps:
            break
        if time_budget_s is not None and state.elapsed_s >= time_budget_s:
            break
        batch, tokens = [], 0
        while tokens < recipe.tokens_per_step:
            s = train[rng.randrange(len(train))]
            batch.append(s)
            tokens += len(s["ids"]) - s["answer_start"]
        for g in opt.param_groups:
            g["lr"] = lr_at(state.step)
        loss, agree, judged, count = _batch_loss(model, head_ids, to_subset, batch)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        state.step += 1
        state.tokens_seen += count
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", agree=f"{agree / max(judged, 1):.2f}")
        if time.monotonic() - last_ckpt > checkpoint_every_s:
            state.history.append(evaluate())
            checkpoint()
            last_ckpt = time.monotonic()
    bar.close()
    state.elapsed_s = time.monotonic() - t0
    state.history.append(evaluate())
    checkpoint()
    print(f"draft: {state.step} steps, {state.tokens_seen} tokens, {state.elapsed_s / 60:.1f} min; "
          f"held-out top-1 agreement with the target {state.history[-1][1]:.3f}; written to {out_dir}")
    return state
