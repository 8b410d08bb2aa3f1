"""`specdec eval draft`: how good and how cheap a draft is for a target, per prompt category.

Reports alpha (greedy: how often the draft's argmax is the target's next token; at temperature
0.7: the expected acceptance probability sum_x min(p(x), q(x)) of rejection sampling, Leviathan et
al. 2023), both over the target's own greedy answers read by both models in one forward), tau at
k, c (draft ms per token / target ms per token, measured here), the speedup predicted by E / (k*c + v(k+1)) next to the measured
one (in-process speculative vs plain, same prompts, same run, outputs compared), the measured
speedup of `--k auto` (the cost-aware schedule the engine uses by default), and the draft's
alpha-vs-training-tokens history when the draft directory recorded one.

Times are the calling thread's CPU time when torch runs one thread on the CPU (much less
disturbed by other processes on a shared machine), else wall time.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from specdec.costmodel import measure_forward_times, measure_verify_cost, predicted_speedup
from specdec.decode import plain_generate, speculative_generate
from specdec.backends.hf import CausalLM
from specdec.proposers import DraftModelProposer
from specdec.types import StopConditions


@dataclass(frozen=True)
class CategoryReport:
    category: str
    prompts: int
    alpha_greedy: float
    alpha_t07: float
    tau: float
    plain_tok_s: float
    spec_tok_s: float
    auto_tok_s: float  # --k auto
    identical: bool

    @property
    def measured_speedup(self) -> float:
        return self.spec_tok_s / self.plain_tok_s if self.plain_tok_s else 0.0

    @property
    def auto_speedup(self) -> float:
        return self.auto_tok_s / self.plain_tok_s if self.plain_tok_s else 0.0


def load_prompt_file(path: Path, tokenizer, per_category: int) -> list[tuple[str, list[int]]]:
    """JSONL with `category` and `turns` (or `prompt`), as specdec/assets/prompts/dev_prompts.jsonl."""
    from specdec.models import format_prompt

    taken: dict[str, int] = defaultdict(int)
    out = []
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        cat = row.get("category", "all")
        if taken[cat] >= per_category:
            continue
        taken[cat] += 1
        text = row["turns"][0] if "turns" in row else row["prompt"]
        out.append((cat, format_prompt(tokenizer, text)))
    return out


def agreement(target: CausalLM, draft: CausalLM, prompt: list[int], answer: list[int],
              temperature: float = 0.7) -> tuple[int, float, int]:
    """Both models read prompt + answer (the target's greedy answer) in one forward each; over the
    answer positions: (greedy hits: draft argmax == the target's token, sum of the acceptance
    probabilities sum_x min(p_T(x), q_T(x)) at `temperature`, positions)."""
    import torch

    if not answer:
        return 0, 0.0, 0
    seq = torch.tensor([list(prompt) + list(answer)])
    span = slice(len(prompt) - 1, seq.shape[1] - 1)
    lt = target.forward(target.new_cache(1), seq).logits[0, span].float()  # [n, vocab]
    ld = draft.forward(draft.new_cache(1), seq).logits[0, span].float()
    hits = int((ld.argmax(-1) == torch.tensor(answer)).sum())
    accept = torch.minimum(torch.softmax(lt / temperature, -1), torch.softmax(ld / temperature, -1)).sum(-1)
    return hits, float(accept.sum()), len(answer)


def evaluate_draft(target: CausalLM, draft: CausalLM, prompts: Sequence[tuple[str, list[int]]], k: int = 4,
                   max_new_tokens: int = 64) -> tuple[list[CategoryReport], dict]:
    from specdec.costmodel import quick_draft_cost, quick_verify_cost, thread_cpu_time_applies, timer
    from specdec.decode import KSchedule

    cpu_time = thread_cpu_time_applies(target)
    clock = timer(cpu_time)
    auto = KSchedule.cost_aware(quick_verify_cost(target), quick_draft_cost(draft, target))
    stop = StopConditions(max_new_tokens=max_new_tokens, eos_token_ids=target.eos_token_ids)
    by_cat: dict[str, list] = defaultdict(list)

    def timed(fn):
        t0 = clock()
        out = fn()[0]
        return out, clock() - t0

    for cat, ids in prompts:
        plain, t_plain = timed(lambda: plain_generate(target, [ids], stop=stop))
        spec, t_spec = timed(lambda: speculative_generate(target, DraftModelProposer(draft), [ids], stop=stop, k=k))
        spec_auto, t_auto = timed(lambda: speculative_generate(target, DraftModelProposer(draft), [ids], stop=stop,
                                                               k=auto))
        by_cat[cat].append((plain, t_plain, spec, t_spec, agreement(target, draft, ids, list(plain.token_ids)),
                            spec_auto, t_auto))
    reports = []
    for cat, rows in by_cat.items():
        def ratio(num, den):
            return num / den if den else 0.0
        reports.append(CategoryReport(
            category=cat, prompts=len(rows),
            alpha_greedy=ratio(sum(r[4][0] for r in rows), sum(r[4][2] for r in rows)),
            alpha_t07=ratio(sum(r[4][1] for r in rows), sum(r[4][2] for r in rows)),
            tau=ratio(sum(r[2].stats.emitted for r in rows), sum(r[2].stats.target_forwards for r in rows)),
            plain_tok_s=ratio(sum(len(r[0].token_ids) for r in rows), sum(r[1] for r in rows)),
            spec_tok_s=ratio(sum(len(r[2].token_ids) for r in rows), sum(r[3] for r in rows)),
            auto_tok_s=ratio(sum(len(r[5].token_ids) for r in rows), sum(r[6] for r in rows)),
            identical=all(r[0].token_ids == r[2].token_ids == r[5].token_ids for r in rows)))
    # Costs: one decode step of each model against a warm cache.
    draft_times, draft_one = measure_forward_times(draft, ks=[1], context_len=256, repeats=7, cpu_time=cpu_time)
    target_times, target_one = measure_forward_times(target, ks=[1], context_len=256, repeats=7, cpu_time=cpu_time)
    curve = measure_verify_cost(target, ks=range(1, k + 2), context_len=256, repeats=5, cpu_time=cpu_time)
    costs = {"c": draft_one / target_one, "draft_ms": draft_one * 1e3, "target_ms": target_one * 1e3, "v": curve,
             "clock": "thread CPU time" if cpu_time else "wall time"}
    return reports, costs


def format_report(reports: Sequence[CategoryReport], costs: dict, k: int, history: Optional[list] = None) -> str:
    c, v = costs["c"], costs["v"]
    lines = [f"c = {c:.3f} (draft {costs['draft_ms']:.1f} ms / target {costs['target_ms']:.1f} ms per token, "
             f"{costs.get('clock', 'wall time')}); v(k+1) = {v[k + 1]:.2f}; k = {k}",
             "| category | prompts | alpha greedy | alpha T=0.7 | tau | predicted | measured | measured, k auto "
             "| identical |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(reports, key=lambda r: r.category):
        lines.append(f"| {r.category} | {r.prompts} | {r.alpha_greedy:.2f} | {r.alpha_t07:.2f} | {r.tau:.2f} | "
                     f"{predicted_speedup(min(r.alpha_greedy, 0.999), k, c, v):.2f}x | {r.measured_speedup:.2f}x | "
                     f"{r.auto_speedup:.2f}x | {'yes' if r.identical else 'NO'} |")
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    lines.append(f"| mean over categories | | {mean([r.alpha_greedy for r in reports]):.2f} | "
                 f"{mean([r.alpha_t07 for r in reports]):.2f} | {mean([r.tau for r in reports]):.2f} | | "
                 f"{mean([r.measured_speedup for r in reports]):.2f}x | {mean([r.auto_speedup for r in reports]):.2f}x | |")
    if history:
        lines.append("\nheld-out top-1 agreement vs training tokens: " +
                     ", ".join(f"{int(h[0])}: {h[1]:.3f}" for h in history))
    return "\n".join(lines)
