"""Medusa-1 head training on a frozen target, from self-distilled data (the target's own answers).

Recipe:
1. Run the target once per sequence (prompt + answer) and keep its last hidden states and its
   argmax at every position (float16, cached on disk in shards under `<out>/hidden-all/`, keyed
   by a hash of the token ids, so more data later only costs the new sequences). Head i at
   position j is trained on the token greedy decoding would emit i + 2 steps after j, which is
   known exactly wherever the text follows the target's argmax for the next i + 1 tokens
   (`head_labels`): everywhere in greedy answers, in stretches of prompts and sampled answers.
   Prompts alone (no generation, one forward each) therefore add exact training positions
   cheaply (`--extra-prompts`).
2. Heads: residual blocks on that state, followed by the target's frozen output layer restricted
   to the `vocab` most frequent answer tokens (+ EOS). The restriction only limits what the
   heads can *draft*; the target still verifies over its full vocabulary, so output is unchanged.
   It makes training and drafting ~6x cheaper at 8192 of 49152 tokens.
3. Loss: cross-entropy per head, head i weighted decay**i (Medusa), AdamW, warm-up then cosine
   decay over the step or time budget; every `heldout_every`-th sequence is held out.
4. The snapshot with the best held-out top-1 (evaluated at every checkpoint) is the one shipped:
   with a few thousand positions the heads overfit within minutes.
5. Checkpoints every few minutes (heads, optimizer, step, elapsed time) with `--resume`; the
   batch order is a function of the step, so a resumed run sees the same batches. The heads
   directory is rewritten at every checkpoint, so an interrupted run still leaves usable heads.
6. At the end: per-head, per-rank accuracy on held-out positions (drives the automatic tree).
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import torch
from tqdm import tqdm

from specdec.errors import InvalidRequest
from specdec.backends.hf import CausalLM
from specdec.medusa_heads import HeadsConfig, MedusaHeads, new_heads, save_heads
from specdec.training.progress import TrainState


@dataclass(frozen=True)
class MedusaRecipe:
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head
    vocab: int = 8192  # draftable tokens: the most frequent answer tokens (+ EOS); 0 = the full vocabulary
    lr: float = 1e-3  # Medusa-1's learning rate for the heads
    warmup_steps: int = 20
    positions_per_step: int = 512  # hidden states per optimizer step
    head_decay: float = 0.8  # loss weight of head i is head_decay ** i (Medusa)
    max_seq: int = 1024  # longer sequences keep their last max_seq tokens
    include_prompt: bool = True  # also train on prompt positions (labels stay exact: see head_labels)
    heldout_every: int = 20  # every n-th sequence (by data order) is held out
    top_ranks: int = 10  # accuracy is measured for candidate ranks 0..top_ranks-1
    seed: int = 0


# TrainState.history here: [(step, held-out top-1 per head)]


@dataclass(frozen=True)
class Example:
    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]
    category: str = ""

    @property
    def key(self) -> str:
        return hashlib.sha1(json.dumps([self.prompt_ids, self.answer_ids]).encode()).hexdigest()[:20]


# --- data -------------------------------------------------------------------------------------

def load_examples(sources: Iterable[str | Path]) -> list[Example]:
    """Self-distilled rows ({"prompt_ids", "answer_ids", "category"} per line) from .jsonl(.gz)
    files, directories of them, or glob patterns; rows without an answer are skipped."""
    files: list[Path] = []
    for src in sources:
        p = Path(src)
        if p.is_dir():
            files += sorted(p.glob("*.jsonl.gz")) + sorted(p.glob("*.jsonl"))
        elif p.is_file():
            files.append(p)
        else:
            files += [Path(f) for f in sorted(glob.glob(str(src)))]
    out = []
    for f in files:
        opener = gzip.open if f.suffix == ".gz" else open
        with opener(f, "rt") as fh:
            for line in fh:
                if not line.strip():
                    continue
                row = json.loads(line)
                if row.get("answer_ids"):
                    out.append(Example(tuple(row["prompt_ids"]), tuple(row["answer_ids"]), row.get("category", "")))
    return out


def frequent_tokens(examples: Sequence[Example], size: int, always: Sequence[int]) -> torch.Tensor:
    """[<= size] sorted token ids: `always` plus the most frequent answer tokens."""
    counts: dict[int, int] = {}
    for ex in examples:
        for t in ex.answer_ids:
            counts[t] = counts.get(t, 0) + 1
    ranked = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    chosen = list(dict.fromkeys(list(always) + ranked))[:size]
    return torch.tensor(sorted(chosen), dtype=torch.long)


@torch.inference_mode()
def sequence_hidden(target: CausalLM, ex: Example, max_seq: int, include_prompt: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One target forward over prompt + answer -> (hidden [n, hidden] at the positions j whose
    next token is trained on (answer tokens, or every token when include_prompt), tokens [n]:
    those next tokens, greedy [n]: the target's argmax at each of those positions)."""
    ids = list(ex.prompt_ids) + list(ex.answer_ids)
    start = 1 if include_prompt else len(ex.prompt_ids)
    cut = max(0, len(ids) - max_seq)
    ids, start = ids[cut:], max(1, start - cut)
    out = target.forward(target.new_cache(1), torch.tensor([ids]), want_hidden=True)
    hidden = out.hidden[0, start - 1 : len(ids) - 1]  # [n, hidden]
    greedy = out.logits[0, start - 1 : len(ids) - 1].argmax(-1)  # [n]
    return (hidden.to(torch.float16).cpu(), torch.tensor(ids[start:], dtype=torch.int32),
            greedy.to(torch.int32).cpu())


class HiddenCache:
    """Shards of per-sequence row tensors on disk, by default (hidden float16 [rows, hidden],
    tokens int32 [rows], greedy int32 [rows]), with offsets [seqs + 1] and an index of which
    example keys each shard holds. `columns`: the tensors' names (each cache holds the same ones)."""

    def __init__(self, root: Path, columns: Sequence[str] = ("hidden", "tokens", "greedy")):
        self.root = Path(root)
        self.columns = tuple(columns)
        self.root.mkdir(parents=True, exist_ok=True)
        index = self.root / "index.json"
        self.index: dict[str, list[str]] = json.loads(index.read_text()) if index.exists() else {}

    def keys(self) -> set[str]:
        return {k for ks in self.index.values() for k in ks}

    def add_shard(self, keys: list[str], *columns: list[torch.Tensor]) -> None:
        """columns: one list per column (in `columns` order) of one tensor per key, as many rows each."""
        from safetensors.torch import save_file

        name = f"shard-{len(self.index):05d}.safetensors"
        offsets = torch.tensor([0] + [len(t) for t in columns[0]]).cumsum(0)
        tmp = self.root / (name + ".tmp")
        save_file({**{c: torch.cat(ts) for c, ts in zip(self.columns, columns, strict=True)}, "offsets": offsets},
                  str(tmp))
        tmp.replace(self.root / name)
        self.index[name] = keys
        tmp = self.root / "index.json.tmp"
        tmp.write_text(json.dumps(self.index))
        tmp.replace(self.root / "index.json")

    def load(self, wanted: Sequence[str]) -> dict[str, tuple[torch.Tensor, ...]]:
        """key -> its columns' tensors, for the wanted keys cached."""
        from safetensors.torch import load_file

        want = set(wanted)
        out = {}
        for name, keys in self.index.items():
            if not want.intersection(keys):
                continue
            t = load_file(str(self.root / name))
            off = t["offsets"].tolist()
            for i, k in enumerate(keys):
                if k in want:
                    out[k] = tuple(t[c][off[i] : off[i + 1]] for c in self.columns)
        return out


def build_hidden_cache(target: CausalLM, examples: Sequence[Example], cache: HiddenCache, max_seq: int,
                       include_prompt: bool = True, shard_seqs: int = 64,
                       time_budget_s: Optional[float] = None) -> int:
    """Compute and store the hidden states of the examples not yet cached; returns how many."""
    return fill_cache(examples, cache, lambda ex: sequence_hidden(target, ex, max_seq, include_prompt),
                      "target hidden states", shard_seqs, time_budget_s)


def fill_cache(examples: Sequence[Example], cache: HiddenCache,
               compute: Callable[[Example], tuple[torch.Tensor, ...]], desc: str, shard_seqs: int = 64,
               time_budget_s: Optional[float] = None) -> int:
    """Store compute(ex) (the cache's columns) for the examples not yet cached, in their order,
    until time_budget_s is spent; returns how many were added."""
    have = cache.keys()
    todo = list({ex.key: ex for ex in examples if ex.key not in have}.values())
    t0 = time.monotonic()
    keys, columns = [], [[] for _ in cache.columns]
    done = 0
    for ex in tqdm(todo, desc=desc, unit="seq", disable=not todo):
        keys.append(ex.key)
        for column, tensor in zip(columns, compute(ex), strict=True):
            column.append(tensor)
        if len(keys) >= shard_seqs:
            cache.add_shard(keys, *columns)
            done += len(keys)
            keys, columns = [], [[] for _ in cache.columns]
        if time_budget_s is not None and time.monotonic() - t0 > time_budget_s:
            break
    if keys:
        cache.add_shard(keys, *columns)
        done += len(keys)
    return done


@dataclass(frozen=True)
class PositionSet:
    hidden: torch.Tensor  # [rows, hidden] float16
    labels: torch.Tensor  # [rows, K] long: head i's target token at each row, -1 past the sequence end

    def __len__(self) -> int:
        return self.hidden.shape[0]


def head_labels(tokens: torch.Tensor, greedy: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Exact greedy targets for the heads, from any text the target read.

    Row j: the hidden state that saw the text up to tokens[j - 1]; tokens[j] is the text's next
    token and greedy[j] the target's argmax there. At decode time the committed token after
    row j is greedy[j], and head i must name the token greedy decoding emits i + 1 steps later.
    Where the text itself follows greedy decoding for the next i + 1 tokens (tokens[j..j+i] ==
    greedy[j..j+i]), that token is greedy[j + 1 + i] exactly. Elsewhere the label is -1
    (unknown without generating). On greedy self-distilled answers every row qualifies; on
    prompts and sampled answers, the greedy-consistent stretches do.
    tokens, greedy [n] -> labels [n, K] long.
    """
    n = tokens.shape[0]
    match = (tokens == greedy).tolist()
    labels = torch.full((n, num_heads), -1, dtype=torch.long)
    run = 0  # length of the matching stretch starting at row j (computed backwards)
    runs = [0] * n
    for j in range(n - 1, -1, -1):
        run = run + 1 if match[j] else 0
        runs[j] = run
    g = greedy.long()
    for i in range(num_heads):
        for j in range(n - 1 - i):
            if runs[j] >= i + 1:
                labels[j, i] = g[j + 1 + i]
    return labels


def position_set(parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], num_heads: int,
                 hidden_size: int) -> PositionSet:
    """Rows with no label for any head are dropped."""
    if not parts:
        return PositionSet(torch.zeros(0, hidden_size, dtype=torch.float16), torch.zeros(0, num_heads, dtype=torch.long))
    hidden = torch.cat([h for h, _, _ in parts])
    labels = torch.cat([head_labels(t, g, num_heads) for _, t, g in parts])
    useful = (labels >= 0).any(1)
    return PositionSet(hidden[useful], labels[useful])


# --- training ---------------------------------------------------------------------------------

def _subset_weight(target: CausalLM, vocab_ids: torch.Tensor) -> torch.Tensor:
    return target.model.get_output_embeddings().weight.detach()[vocab_ids].float()  # [subset, hidden]


def _head_loss(heads: MedusaHeads, hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,
               to_subset: torch.Tensor, decay: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [B, hidden], labels [B, K] (full-vocabulary ids, -1 none) -> (weighted loss,
    top-1 hits [K], counted labels [K]). Labels outside the draftable subset are skipped."""
    logits = heads.states(hidden.float()) @ weight.T  # [B, K, subset]
    sub = torch.where(labels >= 0, to_subset[labels.clamp_min(0)], -1)  # [B, K]
    total = logits.new_zeros(())
    hits, counted = torch.zeros(labels.shape[1]), torch.zeros(labels.shape[1])
    for i in range(labels.shape[1]):
        ok = sub[:, i] >= 0
        if ok.any():
            total = total + decay ** i * torch.nn.functional.cross_entropy(logits[ok, i], sub[ok, i])
        hits[i] = float((logits[:, i].argmax(-1) == sub[:, i]).sum())
        counted[i] = float((labels[:, i] >= 0).sum())
    return total, hits, counted


@torch.no_grad()
def rank_accuracy(heads: MedusaHeads, data: PositionSet, weight: torch.Tensor, to_subset: torch.Tensor,
                  top_ranks: int, batch: int = 1024) -> list[list[float]]:
    """accuracy[i][r]: share of rows whose head-i label is head i's rank-r candidate (labels
    outside the draftable subset count as misses)."""
    k = data.labels.shape[1]
    hits = torch.zeros(k, top_ranks)
    counted = torch.zeros(k)
    for s in range(0, len(data), batch):
        labels = data.labels[s : s + batch]  # [B, K]
        logits = heads.states(data.hidden[s : s + batch].float()) @ weight.T  # [B, K, subset]
        top = logits.topk(min(top_ranks, logits.shape[-1]), dim=-1).indices  # [B, K, R]
        sub = torch.where(labels >= 0, to_subset[labels.clamp_min(0)], -2)  # [B, K]; -2 never matches
        match = top == sub[..., None]  # [B, K, R]
        hits[:, : top.shape[-1]] += match.sum(0).float()
        counted += (labels >= 0).sum(0).float()
    return [[round(float(h) / max(float(c), 1.0), 4) for h in row] for row, c in zip(hits, counted)]


def train_medusa(target: CausalLM, examples: Sequence[Example], out_dir: Path, *,
                 recipe: MedusaRecipe = MedusaRecipe(), target_name: Optional[str] = None,
                 time_budget_s: Optional[float] = None, max_steps: Optional[int] = None, resume: bool = False,
                 checkpoint_every_s: float = 180.0, notes: Optional[dict] = None,
                 log: Callable[[str], None] = print) -> tuple[MedusaHeads, TrainState]:
    """Train heads for `target` on `examples`; writes `out_dir` (heads + config) and, under it,
    `hidden/` (the cache) and `checkpoint.pt`. Stops at max_steps or after time_budget_s of
    training (the hidden-state pass is not counted), whichever comes first."""
    if time_budget_s is None and max_steps is None:
        raise InvalidRequest("give a time budget or a step budget")
    out_dir = Path(out_dir)
    ckpt = out_dir / "checkpoint.pt"
    if ckpt.exists() and not resume:
        raise InvalidRequest(f"{ckpt} exists: pass --resume to continue that run, or choose another --out")
    if not examples:
        raise InvalidRequest("no training examples")
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(recipe.seed)

    # 1. hidden states, once per sequence (cached).
    cache = HiddenCache(out_dir / ("hidden-all" if recipe.include_prompt else "hidden-answers"))
    added = build_hidden_cache(target, examples, cache, recipe.max_seq, recipe.include_prompt)
    if added:
        log(f"cached hidden states of {added} new sequences")
    keys = list(dict.fromkeys(ex.key for ex in examples))
    stored = cache.load(keys)
    held_keys = [k for i, k in enumerate(keys) if i % recipe.heldout_every == 0]
    train_keys = [k for i, k in enumerate(keys) if i % recipe.heldout_every != 0] or held_keys
    hidden_size = int(target.model.get_output_embeddings().weight.shape[1])
    train = position_set([stored[k] for k in train_keys if k in stored], recipe.num_heads, hidden_size)
    heldout = position_set([stored[k] for k in held_keys if k in stored], recipe.num_heads, hidden_size)

    # 2. heads and the draftable vocabulary.
    vocab_ids = (frequent_tokens(examples, recipe.vocab, target.eos_token_ids) if recipe.vocab
                 else torch.arange(target.vocab_size))
    to_subset = torch.full((target.vocab_size,), -1, dtype=torch.long)
    to_subset[vocab_ids] = torch.arange(len(vocab_ids))
    weight = _subset_weight(target, vocab_ids)  # [subset, hidden], frozen
    heads = new_heads(target, recipe.num_heads, recipe.num_layers, target_name,
                      vocab_ids=vocab_ids if recipe.vocab else None).float().train()
    opt = torch.optim.AdamW(heads.parameters(), lr=recipe.lr, weight_decay=0.0)
    state = TrainState()
    # With little data the heads overfit within minutes: keep the snapshot that did best on the
    # held-out positions (top-1 per head, head i weighted head_decay**i) and ship that one.
    best: dict = {"score": -1.0, "step": 0, "heads": None}
    if resume and ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        if saved["recipe"] != asdict(recipe):
            raise InvalidRequest(f"{ckpt} was made with another recipe: {saved['recipe']}")
        heads.load_state_dict(saved["heads"])
        opt.load_state_dict(saved["optimizer"])
        state = TrainState(**saved["state"])
        best = saved.get("best", best)
        log(f"resumed at step {state.step} ({state.elapsed_s / 60:.1f} min trained)")
    log(f"training {recipe.num_heads} heads on {len(train)} positions ({len(train_keys)} sequences), "
        f"held out {len(heldout)} positions; draftable vocabulary {len(vocab_ids)}")

    budget_steps = max_steps if max_steps is not None else 10 ** 9

    def progress() -> float:
        by_steps = state.step / max_steps if max_steps else 0.0
        by_time = state.elapsed_s / time_budget_s if time_budget_s else 0.0
        return min(1.0, max(by_steps, by_time))

    def lr_now() -> float:
        if state.step < recipe.warmup_steps:
            return recipe.lr * (state.step + 1) / recipe.warmup_steps
        return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress())))

    def batch_rows(step: int) -> torch.Tensor:
        # The order is a function of the step: epoch e is the permutation seeded by (seed, e).
        n, b = len(train), min(recipe.positions_per_step, len(train))
        first = step * b
        rows = []
        while len(rows) < b:
            epoch, at = divmod(first + len(rows), n)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(recipe.seed * 1_000_003 + epoch))
            rows += perm[at : at + b - len(rows)].tolist()
        return torch.tensor(rows)

    def heldout_top1() -> list[float]:
        heads.eval()
        acc = rank_accuracy(heads, heldout, weight, to_subset, 1) if len(heldout) else [[0.0]] * recipe.num_heads
        heads.train()
        return [row[0] for row in acc]

    def evaluate() -> None:
        top1 = heldout_top1()
        state.history.append((state.step, top1))
        score = sum(recipe.head_decay ** i * a for i, a in enumerate(top1))
        if score > best["score"]:
            best.update(score=score, step=state.step,
                        heads={k: v.detach().clone() for k, v in heads.state_dict().items()})

    def write(final: bool) -> HeadsConfig:
        heads.eval()
        accuracy = (rank_accuracy(heads, heldout, weight, to_subset, recipe.top_ranks) if final and len(heldout)
                    else [])
        heads.train()
        cfg = replace(heads.config, accuracy=tuple(tuple(r) for r in accuracy),
                      notes={**(notes or {}), "recipe": asdict(recipe), "steps": state.step,
                             "positions_seen": state.tokens_seen, "train_minutes": round(state.elapsed_s / 60, 1),
                             "train_sequences": len(train_keys), "heldout_sequences": len(held_keys),
                             "history": state.history, "selected_step": best["step"] if final else None,
                             "final": final})
        heads.config = cfg
        save_heads(heads, out_dir, cfg)
        tmp = out_dir / "checkpoint.pt.tmp"
        torch.save({"heads": heads.state_dict(), "optimizer": opt.state_dict(), "state": asdict(state),
                    "recipe": asdict(recipe), "best": best}, tmp)
        tmp.replace(ckpt)
        return cfg

    # 3. train.
    t0 = time.monotonic() - state.elapsed_s
    last_ckpt = time.monotonic()
    total = max_steps if max_steps is not None else None
    bar = tqdm(total=total, initial=state.step, desc="medusa heads", unit="step", dynamic_ncols=True)
    hits_avg = torch.zeros(recipe.num_heads)
    while True:
        state.elapsed_s = time.monotonic() - t0
        if state.step >= budget_steps or (time_budget_s is not None and state.elapsed_s >= time_budget_s):
            break
        rows = batch_rows(state.step)
        for g in opt.param_groups:
            g["lr"] = lr_now()
        loss, hits, counted = _head_loss(heads, train.hidden[rows], train.labels[rows], weight, to_subset,
                                         recipe.head_decay)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
        opt.step()
        state.step += 1
        state.tokens_seen += len(rows)
        hits_avg = 0.9 * hits_avg + 0.1 * hits / counted.clamp_min(1) if state.step > 1 else hits / counted.clamp_min(1)
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", top1="/".join(f"{a:.2f}" for a in hits_avg.tolist()),
                        min=f"{state.elapsed_s / 60:.1f}")
        if time.monotonic() - last_ckpt > checkpoint_every_s:
            evaluate()
            write(final=False)
            last_ckpt = time.monotonic()
    bar.close()
    state.elapsed_s = time.monotonic() - t0
    evaluate()
    if best["heads"] is not None and best["step"] != state.step:
        heads.load_state_dict(best["heads"])
        log(f"keeping the step-{best['step']} heads (best on held-out positions)")
    cfg = write(final=True)
    log(f"medusa heads: {state.step} steps, {state.tokens_seen} positions, {state.elapsed_s / 60:.1f} min; "
        f"held-out top-1 per head {[row[0] for row in cfg.accuracy]}, top-5 "
        f"{[round(sum(row[:5]), 3) for row in cfg.accuracy]}; written to {out_dir}")
    return heads.eval(), state


def extra_prompt_examples(target, count: int, seed: int = 7) -> list[Example]:
    """Training prompts without answers (specdec.training.prompts, never the evaluation set),
    chat-formatted: the target only reads them, so they cost one forward each."""
    from specdec.models import format_prompt
    from specdec.training.prompts import training_prompts

    if target.tokenizer is None:
        raise InvalidRequest("--extra-prompts needs a target with a tokenizer")
    return [Example((), tuple(format_prompt(target.tokenizer, p.text)[-384:]), "prompt:" + p.category)
            for p in training_prompts(seed, count)]


def run_training_cli(args) -> int:
    """`specdec train medusa ...`: load, train, summarize."""
    from specdec.medusa_heads import read_config
    from specdec.models import load_model

    data = args.data or ["data/selfdistill"]
    examples = load_examples(data)
    if not any(ex.answer_ids for ex in examples):
        raise InvalidRequest(f"no self-distilled data in {', '.join(data)}: make some with "
                             f"`python -m specdec.training.selfdistill --out data/selfdistill` (never the evaluation set)")
    if args.heads < 1 or args.layers < 1 or args.batch < 1 or args.vocab < 0:
        raise InvalidRequest("--heads, --layers and --batch must be >= 1, --vocab >= 0")
    budget_min = args.time_budget if args.time_budget is not None else (None if args.max_steps else 30.0)
    target = load_model(args.target, backend=args.backend)
    if args.extra_prompts:
        examples += extra_prompt_examples(target, args.extra_prompts)
    recipe = MedusaRecipe(num_heads=args.heads, num_layers=args.layers, vocab=args.vocab, lr=args.lr,
                          positions_per_step=args.batch)
    notes = {"command": " ".join(["specdec", *sys.argv[1:]]) if sys.argv[1:2] == ["train"] else None,
             "data": data, "examples": len(examples), "extra_prompts": args.extra_prompts, "backend": args.backend, "time_budget_min": budget_min, "max_steps": args.max_steps}
    t0 = time.monotonic()
    heads, state = train_medusa(target.lm, examples, Path(args.out), recipe=recipe,
                                target_name=target.lm.name,
                                time_budget_s=None if budget_min is None else budget_min * 60,
                                max_steps=args.max_steps, resume=args.resume,
                                checkpoint_every_s=args.checkpoint_every * 60, notes=notes)
    cfg = read_config(args.out)
    print(f"done in {(time.monotonic() - t0) / 60:.1f} min: {state.step} steps; held-out top-1 per head "
          f"{[row[0] for row in cfg.accuracy]}; heads in {args.out} (use: specdec generate --method medusa "
          f"--heads {args.out} ...)")
    return 0
