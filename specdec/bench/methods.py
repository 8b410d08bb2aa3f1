"""`specdec bench`: specdec's methods side by side with the tools people already use.

One run loads the target once and decodes the same prompts with every method:
- the peers, through transformers `generate`: plain greedy (the baseline users know), assisted
  generation with the same draft specdec uses (`assistant_model`), prompt lookup
  (`prompt_lookup_num_tokens`);
- every method in the registry (specdec.proposers.method_names()) at run time (plain, draft, prompt-lookup, medusa,
  lookahead, ...), on each requested backend;
- anything registered with `register_method` (e.g. specdec through the services).

Methods are interleaved prompt by prompt (in a rotating order), so slow drift of a shared
machine hits all of them alike. Per method and category the report gives tokens/s, speedup vs
transformers' plain `generate` and vs specdec plain, tau (emitted tokens per target forward),
alpha (accepted / drafted), c (drafting time per target forward, in forwards of specdec plain)
and the speedup predicted for a device where verifying a few tokens costs one step (v = 1, a
GPU at batch 1: tau / (1 + c)), and how many outputs equal the baseline's token for token. A
speedup whose outputs differ does not count: the table says so.

Limitations: wall-clock timing of whole requests (prefill included) at batch 1; tau/alpha of
the transformers peers are derived by counting forward calls of their models (alpha is not
reported for prompt lookup, whose drafts are not counted). The v = 1 prediction takes the
draft's cost relative to a target forward as measured on this machine; on a GPU a small draft's
ratio is of the same order (both launch- and memory-bound at batch 1), not the same.
"""

from __future__ import annotations

import json
import os
import platform
import random
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from specdec.errors import InvalidRequest, SpecdecError
from specdec.models import LoadedModel, early_exit_copy, format_prompt, load_model, wrap_model
from specdec.prompt_sets import DEV_PROMPTS, read_prompt_rows
from specdec.types import StopConditions

BASELINE = "hf-generate"
PLAIN = "plain"
PEERS = ("hf-generate", "hf-assisted", "hf-prompt-lookup")


@dataclass(frozen=True)
class BenchConfig:
    target: Optional[str] = None  # None: the embedded default target
    # "shipped": the draft shipped for the target (early-exit:4 if none); a model or specdec draft
    # directory; or early-exit:N (the target's first N layers, untrained)
    draft: str = "shipped"
    eagle: Optional[str] = None  # the EAGLE draft directory for specdec eagle (None: the one shipped for the target)
    eagle_depth: str = "auto"  # EngineConfig.eagle_depth
    prompts: Path = DEV_PROMPTS  # jsonl rows with "id", "category", "turns" (first turn used)
    per_category: int = 5  # prompts per category, a fixed seeded sample; 0 = all of them
    categories: tuple[str, ...] = ()  # () = every category in the file
    max_new_tokens: int = 128
    # tokens drafted per step (specdec draft / prompt-lookup; HF assisted's starting count), or "auto":
    # the engine's cost-aware schedule for specdec (HF assisted then starts at 4 and adapts)
    k: int | str = "auto"
    prompt_lookup_tokens: int = 10  # HF prompt lookup's prompt_lookup_num_tokens (its documented example)
    methods: tuple[str, ...] = ()  # () = every available method
    backends: tuple[str, ...] = ("auto",)  # specdec backends to run its methods on (see models.BACKENDS)
    out: Path = Path("bench/results")
    seed: int = 0
    threads: Optional[int] = None  # torch intra-op threads (None: leave torch's default)
    device: str = "cpu"
    warmup_tokens: int = 8  # each method decodes this many tokens once before timing (0: no warm-up)
    time_budget_s: Optional[float] = None  # start no new prompt after this many seconds (results stay whole)
    # "measured": specdec's methods choose by this machine's verify cost; "flat": as on a device
    # where a forward over up to 64 tokens costs one (costmodel.FLAT_VERIFY_COST: a GPU at batch 1)
    verify_cost: str = "measured"

    def __post_init__(self) -> None:
        if self.verify_cost not in VERIFY_COSTS:
            raise InvalidRequest(f"verify_cost must be one of {', '.join(VERIFY_COSTS)}, not {self.verify_cost!r}")
        if self.per_category < 0:
            raise InvalidRequest("per_category must be >= 0 (0 = all prompts)")
        if self.max_new_tokens < 1 or (self.k != "auto" and (not isinstance(self.k, int) or self.k < 1)):
            raise InvalidRequest("max_new_tokens must be >= 1 and k >= 1 or 'auto'")
        if not self.backends:
            raise InvalidRequest("give at least one backend")


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class RunRecord:
    method: str
    prompt_id: str
    category: str
    token_ids: tuple[int, ...]
    seconds: float
    target_forwards: Optional[int] = None
    drafted: Optional[int] = None
    accepted: Optional[int] = None
    cpu_seconds: float = 0.0  # process CPU time of the call: robust to other processes on a shared machine
    draft_seconds: Optional[float] = None  # time in the proposer (drafting), where the method drafts


@dataclass
class BenchContext:
    """What method factories get: the loaded models and the settings."""

    config: BenchConfig
    target: LoadedModel  # transformers backend: its .lm.model is the transformers module
    draft: Optional[LoadedModel]  # transformers backend
    stop: StopConditions
    engines: dict[str, Any] = field(default_factory=dict)  # backend -> specdec Engine ("auto" resolved)


# A runner decodes one prompt and returns its record (the harness fills in timing and names).
Runner = Callable[[BenchPrompt], RunRecord]
MethodFactory = Callable[[BenchContext], Runner]
EXTRA_METHODS: dict[str, MethodFactory] = {}


def register_method(name: str, factory: MethodFactory) -> None:
    """Add a method to every benchmark run (e.g. specdec through its services)."""
    if name in EXTRA_METHODS or name in PEERS:
        raise ValueError(f"bench method {name!r} is already registered")
    EXTRA_METHODS[name] = factory


# --- prompts ----------------------------------------------------------------------------------

def select_rows(rows: Sequence[dict], per_category: int, categories: Sequence[str], seed: int) -> list[dict]:
    """A fixed, seeded sample of `per_category` rows per category (all when 0), interleaved
    across categories, in a deterministic order."""
    by_cat: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_cat[row["category"]].append(row)
    wanted = list(categories) or sorted(by_cat)
    unknown = [c for c in wanted if c not in by_cat]
    if unknown:
        raise InvalidRequest(f"no prompts in categories {unknown}; the file has {sorted(by_cat)}")
    picked: list[list[dict]] = []
    for cat in wanted:
        pool = sorted(by_cat[cat], key=lambda r: str(r["id"]))
        if per_category and per_category < len(pool):
            pool = random.Random(f"{seed}:{cat}").sample(pool, per_category)
        picked.append(pool)
    out = []
    for i in range(max(len(p) for p in picked)):
        out += [p[i] for p in picked if i < len(p)]
    return out


def load_prompts(config: BenchConfig, tokenizer) -> list[BenchPrompt]:
    rows = read_prompt_rows(config.prompts)
    return [BenchPrompt(str(r["id"]), r["category"], tuple(format_prompt(tokenizer, r["turns"][0])))
            for r in select_rows(rows, config.per_category, config.categories, config.seed)]


# --- the transformers peers -------------------------------------------------------------------

class _CallCounter:
    """Counts forward calls of a module (one per target forward pass)."""

    def __init__(self, module: torch.nn.Module):
        self.calls = 0
        module.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1


def _hf_runner(ctx: BenchContext, **generate_kwargs) -> Runner:
    model = ctx.target.lm.model
    counter = getattr(model, "_specdec_bench_counter", None) or _CallCounter(model)
    model._specdec_bench_counter = counter
    assistant = generate_kwargs.get("assistant_model")
    draft_counter = None
    if assistant is not None:
        draft_counter = getattr(assistant, "_specdec_bench_counter", None) or _CallCounter(assistant)
        assistant._specdec_bench_counter = draft_counter
    eos = list(ctx.stop.eos_token_ids)
    pad = eos[0] if eos else 0
    device = ctx.target.lm.device

    def run(prompt: BenchPrompt) -> RunRecord:
        ids = torch.tensor([prompt.token_ids], device=device)
        before = counter.calls
        drafts_before = draft_counter.calls if draft_counter else 0
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=ctx.stop.max_new_tokens, eos_token_id=eos or None,
                                 pad_token_id=pad, **generate_kwargs)
        tokens = tuple(int(t) for t in out[0, ids.shape[1]:].tolist())
        forwards = counter.calls - before
        drafted = accepted = None
        if draft_counter is not None:  # one assistant call per drafted token (its prefill included)
            drafted = draft_counter.calls - drafts_before
            accepted = max(len(tokens) - forwards, 0)
        return RunRecord("", prompt.id, prompt.category, tokens, 0.0, forwards, drafted, accepted)

    return run


def _hf_generate(ctx: BenchContext) -> Runner:
    return _hf_runner(ctx)


def _hf_assisted(ctx: BenchContext) -> Runner:
    if ctx.draft is None:
        raise InvalidRequest("no draft model")
    assistant = ctx.draft.lm.model
    # HF then adapts it (heuristic schedule)
    assistant.generation_config.num_assistant_tokens = 4 if ctx.config.k == "auto" else ctx.config.k
    return _hf_runner(ctx, assistant_model=assistant)


def _hf_prompt_lookup(ctx: BenchContext) -> Runner:
    return _hf_runner(ctx, prompt_lookup_num_tokens=ctx.config.prompt_lookup_tokens)


def _llamacpp_runner(ctx: BenchContext, lookup: bool) -> Runner:
    """llama-cpp-python's own greedy generation on the GGUF that specdec's llamacpp backend runs
    (what a CPU user would run instead), optionally with its prompt-lookup decoding."""
    engine = ctx.engines.get("llamacpp")
    if engine is None:
        raise InvalidRequest("the llama.cpp peers run beside specdec's llamacpp backend (--backend ...,llamacpp)")
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    lm = engine.target.lm
    draft = LlamaPromptLookupDecoding(num_pred_tokens=ctx.config.prompt_lookup_tokens) if lookup else None
    # logits_all with the lookup: llama-cpp-python 0.3.36 sizes its logits buffer by that argument but
    # fills it for every token when it has a draft model (prompts over n_batch tokens failed otherwise).
    llm = Llama(model_path=str(lm.path), n_ctx=lm.max_positions, n_threads=lm.threads, n_threads_batch=lm.threads,
                draft_model=draft, logits_all=lookup, verbose=False)
    eos = set(ctx.stop.eos_token_ids)

    def run(prompt: BenchPrompt) -> RunRecord:
        llm.reset()  # no reuse of an earlier prompt's KV entries (specdec reuses none either)
        tokens: list[int] = []
        for tok in llm.generate(list(prompt.token_ids), temp=0.0, top_k=1, reset=True):
            tokens.append(int(tok))
            if tok in eos or len(tokens) >= ctx.stop.max_new_tokens:
                break
        return RunRecord("", prompt.id, prompt.category, tuple(tokens), 0.0)

    return run


PEER_FACTORIES: dict[str, MethodFactory] = {
    "hf-generate": _hf_generate,
    "hf-assisted": _hf_assisted,
    "hf-prompt-lookup": _hf_prompt_lookup,
    # Compared with specdec plain on the same backend (= own plain): llama.cpp rounds differently.
    "llamacpp-generate@llamacpp": lambda ctx: _llamacpp_runner(ctx, lookup=False),
    "llamacpp-prompt-lookup@llamacpp": lambda ctx: _llamacpp_runner(ctx, lookup=True),
}


# --- specdec methods --------------------------------------------------------------------------

def method_label(method: str, backend: str, backends: Sequence[str]) -> str:
    """Table name of a specdec method: the engine's name, with the backend when several run."""
    return method if len(backends) == 1 else f"{method}@{backend}"


def _specdec_runner(ctx: BenchContext, method: str, backend: str) -> Runner:
    from specdec.decode import plain_generate, speculative_generate

    engine = ctx.engines[backend]
    method = engine.resolve_method(method)  # "auto": what `specdec generate` would run here
    factory = engine.proposer_factory(method)  # fails now (e.g. missing Medusa heads), not on the first prompt
    lm = engine.target.lm
    schedule = engine.k_schedule(method, ctx.config.k)  # measured before any clock starts

    def run(prompt: BenchPrompt) -> RunRecord:
        ids = [list(prompt.token_ids)]
        if factory is None:
            t0 = time.perf_counter()
            res = plain_generate(lm, ids, stop=ctx.stop)[0]
        else:
            proposer = factory()  # fresh per prompt, built before the clock starts
            t0 = time.perf_counter()
            res = speculative_generate(lm, proposer, ids, stop=ctx.stop, k=schedule)[0]
        dt = time.perf_counter() - t0
        s = res.stats
        drafts = factory is not None
        return RunRecord("", prompt.id, prompt.category, tuple(res.token_ids), dt, s.target_forwards,
                         s.drafted if drafts else None, s.accepted if drafts else None,
                         draft_seconds=s.draft_s if drafts else None)

    return run


# --- loading ----------------------------------------------------------------------------------

def load_draft_for_bench(spec: str, target: LoadedModel, device: str) -> LoadedModel:
    """`shipped`: the draft shipped for the target (else early-exit:4); `early-exit:N`: the
    target's first N layers (an untrained draft); a specdec draft directory; else a model directory."""
    from specdec.drafts import is_draft_dir, load_draft, shipped_draft_path
    from specdec.models import check_compatible

    if spec == "shipped":
        path = shipped_draft_path(target.lm.name)
        spec = str(path) if path is not None else "early-exit:4"
    if spec.startswith("early-exit:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            raise InvalidRequest(f"bad draft spec {spec!r}; use shipped, early-exit:N or a directory") from None
        lm = early_exit_copy(target.lm, n)
        lm.model.to(device)
        return LoadedModel(lm=lm, tokenizer=target.tokenizer, path=spec)
    if is_draft_dir(Path(spec)):
        return LoadedModel(lm=load_draft(Path(spec), target.lm, backend="hf"), tokenizer=target.tokenizer, path=spec)
    draft = load_model(spec, device=device)
    check_compatible(target, draft)
    return draft


def build_context(config: BenchConfig, target: Optional[LoadedModel] = None,
                  draft: Optional[LoadedModel] = None) -> BenchContext:
    """Load (or adopt) the models and build one specdec Engine per backend over the same weights."""
    from specdec.engine import Engine, EngineConfig

    if target is None:
        target = load_model(config.target, device=config.device, backend="hf")
    if draft is None and config.draft:
        draft = load_draft_for_bench(config.draft, target, config.device)
    eos = target.lm.eos_token_ids
    ctx = BenchContext(config, target, draft, StopConditions(max_new_tokens=config.max_new_tokens, eos_token_ids=eos))
    for backend in dict.fromkeys(_resolve_auto(config, target, b) for b in config.backends):
        if backend == "llamacpp":
            ctx.engines[backend] = _llamacpp_engine(config, draft)
            continue
        ctx.engines[backend] = Engine.from_models(_on_backend(target, backend),
                                                  None if draft is None else _on_backend(draft, backend),
                                                  EngineConfig(target=config.target, prefix_cache_mb=0, history_tokens=0,
                                                               eagle_dir=config.eagle, eagle_depth=config.eagle_depth),
                                                  costs=_assumed_costs(config))
    return ctx


VERIFY_COSTS = ("measured", "flat")


def _assumed_costs(config: BenchConfig):
    """None (the engine's store of this machine's costs), or the store of `--verify-cost flat`."""
    from specdec.costmodel import FLAT_VERIFY_COST, AssumedVerifyCost

    return AssumedVerifyCost(FLAT_VERIFY_COST) if config.verify_cost == "flat" else None


def _resolve_auto(config: BenchConfig, target: LoadedModel, backend: str) -> str:
    """A backend name, "auto" resolved as `specdec generate` resolves it for its default method
    (specdec.backends.choice: measured once per machine and kept)."""
    from specdec.backends.choice import dual_gguf, faster_backend
    from specdec.engine import EngineConfig, default_cost_store
    from specdec.models import load_gguf_model, resolve_backend

    gguf = dual_gguf(config.target) if config.device == "cpu" else None
    if backend != "auto" or gguf is None:
        return resolve_backend(target.lm.model, backend)
    costs = default_cost_store(EngineConfig())
    loaders = {"fast": lambda: _on_backend(target, "fast"),
               "llamacpp": lambda: load_gguf_model(config.target, costs=costs)}
    return faster_backend(gguf, costs, loaders)


def _llamacpp_engine(config: BenchConfig, draft: Optional[LoadedModel]):
    """The target's GGUF on llama.cpp; a specdec draft directory is loaded again onto the GGUF's
    embeddings (other drafts are built from the transformers target and cannot follow)."""
    from specdec.drafts import is_draft_dir, load_draft
    from specdec.engine import Engine, EngineConfig
    from specdec.models import load_gguf_model

    target = load_gguf_model(config.target)
    on_cpp = None
    if draft is not None and is_draft_dir(Path(draft.path)):
        on_cpp = LoadedModel(lm=load_draft(Path(draft.path), target.lm, backend="auto"), tokenizer=target.tokenizer,
                             path=draft.path)
    return Engine.from_models(target, on_cpp,
                              EngineConfig(target=config.target, backend="llamacpp", prefix_cache_mb=0, history_tokens=0,
                                           eagle_dir=config.eagle, eagle_depth=config.eagle_depth),
                              costs=_assumed_costs(config))


def _on_backend(loaded: LoadedModel, backend: str) -> LoadedModel:
    """The same weights behind another backend's adapter. Models the fast backend cannot run, and
    adapters with their own forward (e.g. subset-head drafts), stay as they are."""
    from specdec.backends.fast import FastLlamaLM, supports_fast
    from specdec.backends.hf import CausalLM
    from specdec.backends.subset_head import SubsetHeadLM

    lm = loaded.lm
    rows = lm.head_rows
    if backend == "hf":
        if lm.backend not in ("fast", "fast-bf16"):
            return loaded
        hf = CausalLM(lm.model, lm.name) if rows is None else SubsetHeadLM(lm.model, rows, lm.name)
        return replace(loaded, lm=hf)
    if lm.backend != "hf" or supports_fast(lm.config) is not None:
        return loaded
    if rows is not None:  # a subset-head draft: the fast forward scores the same rows
        return replace(loaded, lm=FastLlamaLM(lm.model, name=lm.name, head_rows=rows,
                                              weight_dtype=torch.bfloat16 if backend == "fast-bf16" else None))
    return LoadedModel(wrap_model(lm.model, lm.name, backend), loaded.tokenizer, loaded.path)


def available_methods(ctx: BenchContext) -> tuple[dict[str, Runner], dict[str, str]]:
    """(label -> runner, label -> why unavailable) for the configured methods."""
    from specdec.engine import AUTO
    from specdec.proposers import method_names

    cfg = ctx.config
    wanted = list(cfg.methods)
    runners: dict[str, Runner] = {}
    missing: dict[str, str] = {}
    candidates: list[tuple[str, Callable[[], Runner]]] = []
    for name, factory in PEER_FACTORIES.items():
        candidates.append((name, lambda f=factory: f(ctx)))
    backends = list(ctx.engines)
    for method in (AUTO, *method_names()):
        for backend in backends:
            candidates.append((method_label(method, backend, backends),
                               lambda m=method, b=backend: _specdec_runner(ctx, m, b)))
    for name, factory in EXTRA_METHODS.items():
        candidates.append((name, lambda f=factory: f(ctx)))
    known = {label for label, _ in candidates} | {label.split("@")[0] for label, _ in candidates}
    unknown = [m for m in wanted if m not in known]
    if unknown:
        raise InvalidRequest(f"unknown bench methods {unknown}; known: {', '.join(sorted(known))}")
    for label, make in candidates:
        base = label.split("@")[0]
        if wanted and label not in wanted and base not in wanted:
            continue
        try:
            runners[label] = make()
        except (SpecdecError, OSError, ValueError, KeyError) as exc:
            missing[label] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if BASELINE not in runners:
        raise InvalidRequest(f"the benchmark needs its baseline {BASELINE!r} among the methods")
    return runners, missing


# --- running ----------------------------------------------------------------------------------

def run_interleaved(runners: dict[str, Runner], prompts: Sequence[BenchPrompt],
                    progress: Optional[Callable[[str], None]] = None,
                    time_budget_s: Optional[float] = None) -> tuple[list[RunRecord], dict[str, str]]:
    """Every method on every prompt, prompt by prompt; the method order rotates per prompt.
    With a time budget, no new prompt starts once it is spent (every prompt run has all methods).
    A method that raises is dropped from the whole run (its records too) and reported with its
    error, so one broken method cannot sink the comparison. Returns (records, failures)."""
    names = list(runners)
    records: list[RunRecord] = []
    failed: dict[str, str] = {}
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        if time_budget_s is not None and time.perf_counter() - start > time_budget_s:
            if progress:
                progress(f"time budget spent: stopping after {i} of {len(prompts)} prompts")
            break
        order = names[i % len(names):] + names[: i % len(names)]
        for name in order:
            if name in failed:
                continue
            c0, t0 = time.process_time(), time.perf_counter()
            try:
                rec = runners[name](prompt)
            except Exception as exc:  # noqa: BLE001 -- reported in the table, never silently
                first_line = str(exc).splitlines()[0] if str(exc) else ""
                failed[name] = f"failed on prompt {prompt.id}: {type(exc).__name__}: {first_line}"
                if progress:
                    progress(f"{name}: {failed[name]}")
                continue
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            rec = replace(rec, method=name, seconds=rec.seconds or dt, cpu_seconds=cpu)
            records.append(rec)
            if progress:
                progress(f"[{i + 1}/{len(prompts)}] {prompt.category:13s} {name:20s} {len(rec.token_ids):4d} tok "
                         f"{rec.seconds:6.2f} s")
    if BASELINE in failed:
        raise SpecdecError(f"the baseline {BASELINE} {failed[BASELINE]}")
    return [r for r in records if r.method not in failed], failed


@dataclass(frozen=True)
class Row:
    method: str
    category: str
    prompts: int
    tokens: int
    seconds: float
    tokens_per_s: float
    tokens_per_cpu_s: float
    speedup_vs_hf: Optional[float]
    cpu_speedup_vs_hf: Optional[float]  # the same ratio in process CPU time
    speedup_vs_plain: Optional[float]
    tau: Optional[float]
    alpha: Optional[float]
    draft_cost: Optional[float]  # drafting time per target forward, in forwards of specdec plain (same backend)
    predicted_v1: Optional[float]  # predicted x plain where a verify forward costs one plain step (v = 1)
    equal_hf: int  # outputs identical to transformers' plain generate
    equal_plain: Optional[int]  # outputs identical to specdec plain (same backend)


def draft_cost(records: Sequence[RunRecord], plain: Sequence[RunRecord]) -> Optional[float]:
    """D: a method's drafting time per target forward, in units of one forward of specdec plain on
    the same backend and prompts (plain's seconds per forward, prefill included); 0 for plain itself;
    None where either was not measured."""
    if not records or not plain or any(r.target_forwards is None for r in (*records, *plain)):
        return None
    if all(r.method == plain[0].method for r in records):
        return 0.0
    if any(r.draft_seconds is None for r in records):
        return None
    plain_step = sum(r.seconds for r in plain) / max(1, sum(r.target_forwards for r in plain))
    forwards = sum(r.target_forwards for r in records)
    return sum(r.draft_seconds for r in records) / forwards / plain_step if forwards and plain_step > 0 else None


def predicted_speedup_v1(tau: Optional[float], cost: Optional[float]) -> Optional[float]:
    """Tokens/s over plain on a device where a verify forward over the few drafted tokens costs
    what a one-token forward does (v(k + 1) = 1: a GPU at batch 1): each step emits tau tokens for
    one forward plus the drafting, `cost` forwards (draft_cost: its ratio to a target forward
    taken as measured here). Plain predicts 1."""
    if tau is None or cost is None:
        return None
    return tau / (1.0 + cost)


def summarize(records: Sequence[RunRecord], methods: Sequence[str]) -> list[Row]:
    by = defaultdict(list)
    for r in records:
        by[(r.method, r.category)].append(r)
        by[(r.method, "all")].append(r)
    ref = {(r.prompt_id): r.token_ids for r in records if r.method == BASELINE}
    categories = sorted({r.category for r in records}) + ["all"]

    def plain_of(method: str) -> Optional[str]:
        """specdec plain on the method's backend (bare "plain" when the run has one backend)."""
        backend = method.split("@")[1] if "@" in method else None
        names = ([f"{PLAIN}@{backend}"] if backend else []) + [PLAIN]
        return next((n for n in names if any(r.method == n for r in records)), None)

    plain_out = {(r.method, r.prompt_id): r.token_ids for r in records}
    rows = []
    for cat in categories:
        tps, tpc = {}, {}
        for m in methods:
            rs = by.get((m, cat), [])
            tokens = sum(len(r.token_ids) for r in rs)
            secs, cpu = sum(r.seconds for r in rs), sum(r.cpu_seconds for r in rs)
            tps[m] = tokens / secs if secs > 0 else 0.0
            tpc[m] = tokens / cpu if cpu > 0 else 0.0
        for m in methods:
            rs = by.get((m, cat), [])
            if not rs:
                continue
            fw = [r.target_forwards for r in rs]
            dr = [r.drafted for r in rs]
            ac = [r.accepted for r in rs]
            tokens = sum(len(r.token_ids) for r in rs)
            p = plain_of(m)
            tau = tokens / sum(fw) if None not in fw and sum(fw) else None
            cost = draft_cost(rs, by.get((p, cat), []) if p else [])
            rows.append(Row(
                method=m, category=cat, prompts=len(rs), tokens=tokens, seconds=sum(r.seconds for r in rs),
                tokens_per_s=tps[m], tokens_per_cpu_s=tpc[m],
                speedup_vs_hf=tps[m] / tps[BASELINE] if tps.get(BASELINE) else None,
                cpu_speedup_vs_hf=tpc[m] / tpc[BASELINE] if tpc.get(BASELINE) else None,
                speedup_vs_plain=tps[m] / tps[p] if p and tps.get(p) else None,
                tau=tau,
                alpha=sum(ac) / sum(dr) if None not in dr and None not in ac and sum(dr) else None,
                draft_cost=cost,
                predicted_v1=predicted_speedup_v1(tau, cost),
                equal_hf=sum(r.token_ids == ref.get(r.prompt_id) for r in rs),
                equal_plain=sum(r.token_ids == plain_out.get((p, r.prompt_id)) for r in rs) if p else None,
            ))
    return rows


# --- reporting --------------------------------------------------------------------------------

def _f(x: Optional[float], fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def markdown_report(rows: Sequence[Row], missing: dict[str, str], meta: dict) -> str:
    methods = list(dict.fromkeys(r.method for r in rows))
    categories = list(dict.fromkeys(r.category for r in rows))
    overall = {r.method: r for r in rows if r.category == "all"}
    lines = [
        "# specdec benchmark",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"{meta['when']} · {meta['machine']} · torch {meta['torch']} ({meta['threads']} threads) · "
        f"target {meta['target']} · draft {meta['draft']} · backends {', '.join(meta['backends'])} · "
        f"{meta['prompts']} prompts ({meta['per_category']} per category), greedy, max {meta['max_new_tokens']} "
        f"new tokens, k={meta['k']} · load average {meta['load_before']} -> {meta['load_after']}",
        "",
        "Speedups are ratios of tokens/s over the same prompts in the same interleaved run. "
        "`=HF`: outputs identical token for token to transformers' plain `generate` (the baseline); "
        "`=plain`: identical to specdec plain on the same backend. A speedup with different output does not count. "
        "`x HF in CPU time`: the same ratio in process CPU time, which other processes on a shared machine "
        "disturb less than wall time (meaningful with --threads 1). "
        "`c`: drafting time per target forward, in forwards of specdec plain on the same backend; "
        "`x plain at v=1`: the speedup predicted where verifying a few tokens costs one plain step "
        "(a GPU at batch 1), tau / (1 + c), taking c as measured here.",
        "",
        *([] if meta.get("verify_cost", "measured") == "measured" else [
            "**Verify cost assumed flat** (`--verify-cost flat`): specdec's methods chose their chains, "
            "trees and k as on a device where a forward over up to 64 tokens costs one (a GPU at batch 1), "
            "so tau, alpha and `x plain at v=1` are what that device would show; tokens/s and the speedups "
            "measured here are this CPU's running those choices, not what it would choose.", ""]),
        "## Overall",
        "",
        "| method | tok/s | x HF generate | x specdec plain | x HF in CPU time | tau | alpha | c | x plain at v=1 "
        "| =HF | =plain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in methods:
        r = overall[m]
        lines.append(f"| {m} | {r.tokens_per_s:.1f} | {_f(r.speedup_vs_hf)} | {_f(r.speedup_vs_plain)} | "
                     f"{_f(r.cpu_speedup_vs_hf)} | "
                     f"{_f(r.tau)} | {_f(r.alpha)} | {_f(r.draft_cost)} | {_f(r.predicted_v1)} | "
                     f"{r.equal_hf}/{r.prompts} | {'-' if r.equal_plain is None else f'{r.equal_plain}/{r.prompts}'} |")
    lines += ["", "## Speedup vs HF generate, by category", "",
              "| method | " + " | ".join(categories) + " |", "|---|" + "---:|" * len(categories)]
    cell = {(r.method, r.category): r for r in rows}
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(
            _f(cell[(m, c)].speedup_vs_hf) + ("" if cell[(m, c)].equal_hf == cell[(m, c)].prompts else " ≠")
            if (m, c) in cell else "-" for c in categories) + " |")
    lines += ["", "≠: at least one output differs from HF generate's in that cell.", "",
              "## Per method and category", "",
              "| method | category | prompts | tokens | tok/s | x HF | x plain | tau | alpha | c | x plain at v=1 "
              "| =HF | =plain |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.category == "all":
            continue
        lines.append(f"| {r.method} | {r.category} | {r.prompts} | {r.tokens} | {r.tokens_per_s:.1f} | "
                     f"{_f(r.speedup_vs_hf)} | {_f(r.speedup_vs_plain)} | {_f(r.tau)} | {_f(r.alpha)} | "
                     f"{_f(r.draft_cost)} | {_f(r.predicted_v1)} | {r.equal_hf}/{r.prompts} | {'-' if r.equal_plain is None else f'{r.equal_plain}/{r.prompts}'} |")
    if missing:
        lines += ["", "## Not run", ""] + [f"- {m}: {why}" for m, why in missing.items()]
    return "\n".join(lines) + "\n"


def plot_speedups(rows: Sequence[Row], path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r.method for r in rows))
    categories = list(dict.fromkeys(r.category for r in rows))
    cell = {(r.method, r.category): r for r in rows}
    width = 0.8 / max(len(methods), 1)
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(categories) + 0.3 * len(methods)), 4.8))
    for i, m in enumerate(methods):
        xs, ys, hatches = [], [], []
        for j, c in enumerate(categories):
            r = cell.get((m, c))
            if r is None or r.speedup_vs_hf is None:
                continue
            xs.append(j - 0.4 + width * (i + 0.5))
            ys.append(r.speedup_vs_hf)
            hatches.append("" if r.equal_hf == r.prompts else "//")
        bars = ax.bar(xs, ys, width, label=m)
        for bar, h in zip(bars, hatches):
            bar.set_hatch(h)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(categories)), categories)
    ax.set_ylabel("speedup vs transformers generate (tok/s ratio)")
    ax.set_title(title or "specdec benchmark (hatched: output differs from HF generate)")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- the whole run ----------------------------------------------------------------------------

def run_bench(config: BenchConfig, command: str = "specdec bench", target: Optional[LoadedModel] = None,
              draft: Optional[LoadedModel] = None, prompts: Optional[Sequence[BenchPrompt]] = None,
              progress: Optional[Callable[[str], None]] = None) -> dict:
    """Run the benchmark and write results.md, speedup.png and results.json to config.out."""
    if config.threads:
        torch.set_num_threads(config.threads)
    load_before = _loadavg()
    ctx = build_context(config, target, draft)
    if prompts is None:
        if ctx.target.tokenizer is None:
            raise InvalidRequest("the target has no tokenizer; pass token-id prompts")
        prompts = load_prompts(config, ctx.target.tokenizer)
    runners, missing = available_methods(ctx)
    if progress:
        progress(f"{len(prompts)} prompts x {len(runners)} methods: {', '.join(runners)}")
        for m, why in missing.items():
            progress(f"skipping {m}: {why}")
    if config.warmup_tokens and prompts:  # first calls pay one-off costs (allocations, lazy tables)
        saved = ctx.stop
        ctx.stop = replace(saved, max_new_tokens=config.warmup_tokens)
        _, failed = run_interleaved(runners, prompts[:1], progress=progress)
        ctx.stop = saved
        missing.update(failed)
        runners = {k: v for k, v in runners.items() if k not in failed}
    records, failed = run_interleaved(runners, prompts, progress=progress, time_budget_s=config.time_budget_s)
    missing.update(failed)
    rows = summarize(records, [m for m in runners if m not in failed])
    done = {r.prompt_id for r in records}
    meta = {
        "command": command, "when": time.strftime("%Y-%m-%d %H:%M"), "machine": _machine(config.device),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "target": ctx.target.lm.name,
        "draft": ctx.draft.path if ctx.draft is not None else "none", "backends": list(ctx.engines),
        "prompts": len(done), "per_category": config.per_category or "all",
        "max_new_tokens": config.max_new_tokens, "k": config.k, "load_before": load_before,
        "load_after": _loadavg(), "verify_cost": config.verify_cost,
    }
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(markdown_report(rows, missing, meta))
    plot_speedups(rows, out / "speedup.png")
    result = {"meta": meta, "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
              "rows": [asdict(r) for r in rows], "missing": missing, "records": [asdict(r) for r in records]}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    return result


def _loadavg() -> str:
    try:
        return "{:.1f}".format(os.getloadavg()[0])
    except OSError:
        return "?"


def _machine(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
