"""The in-process engine: a loaded target (plus optional draft) and one call that decodes
a prompt with any method. The CLI and the services are thin shells around it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from specdec.costmodel import AUTO_ALPHA, CostStore, choose_method
from specdec.decode import KSchedule, OnEmit, plain_generate, speculative_generate
from specdec.errors import InvalidRequest
from specdec.models import (LoadedModel, check_compatible, format_prompt, load_model,
                            user_cost_store)
from specdec.prefix_cache import PrefixCache
from specdec.token_history import MAX_DRAFT, HistoryProposer, MatchAcceptance, TokenHistory, drafts_for
from specdec.proposers import PLAIN, ProposerEnv, ProposerFactory, load_proposer, method_names
from specdec.proposers.lookahead import LookaheadConfig
from specdec.stopping import TextStream, cut_at_stop_string
from specdec.types import GenerationResult, SamplingParams, StopConditions


# The method `specdec generate` uses unless told: see Engine.resolve_method.
AUTO = "auto"


EAGLE_DEPTHS = ("auto", "k")


@dataclass(frozen=True)
class EngineConfig:
    target: Optional[str] = None  # None: the embedded default (SmolLM2-135M-Instruct)
    draft: Optional[str] = None  # draft directory (None: the draft shipped for the target, loaded on first use)
    cache_dir: Optional[Path] = None  # where the embedded default is cached (None: ~/.cache/specdec)
    # where measured costs (v(k), the draft cost c) are kept across runs (None: ~/.cache/specdec/costs)
    cost_cache: Optional[Path] = None
    # How the target runs (models.BACKENDS). "auto": for the embedded default, whichever of llama.cpp
    # (its GGUF) and the float32 fast forward measures faster here for the methods below
    # (specdec.backends.choice); for other models the fast forward for float32 Llama-family models on CPU, else hf.
    backend: str = "auto"
    # The methods this engine will be asked for: backend "auto" picks one that runs them all (Lookahead
    # needs a torch backend; Medusa runs a chain on llama.cpp); () = not said: the measured choice, as
    # `specdec generate` makes it for its default method.
    methods: tuple[str, ...] = ()
    medusa_heads: Optional[str] = None  # Medusa heads directory (None: the heads shipped for the target)
    medusa_tree: Optional[str] = None  # Medusa tree: None/"auto", "chain", a node count, or JSON paths
    lookahead: LookaheadConfig = LookaheadConfig()  # window W, n-gram size N, guesses G for "lookahead"
    # EAGLE draft directory for "eagle" (None: the one shipped for the target in
    # specdec/assets/eagle/<target>/, made by `specdec train eagle`)
    eagle_dir: Optional[str] = None
    # How deep EAGLE's chains go: "auto", each step as deep as the draft's confidence pays for on
    # the target's measured verify cost (at most k; specdec.proposers.eagle.DepthChoice); "k": k tokens
    eagle_depth: str = "auto"
    # MiB of KV of earlier prompts and answers kept to be reused by later calls that start the same
    # way (a shared system prompt or document, a conversation's next turn; one prompt per call); 0: off
    prefix_cache_mb: int = 256
    # Tokens of earlier calls' prompts and answers kept for drafts (specdec.token_history): plain
    # decoding drafts what followed where a prompt's or answer's end matches one of them; 0: off
    history_tokens: int = 1 << 17

    def __post_init__(self) -> None:
        if self.eagle_depth not in EAGLE_DEPTHS:
            raise InvalidRequest(f"eagle_depth must be one of {', '.join(EAGLE_DEPTHS)}, got {self.eagle_depth!r}")


@dataclass(frozen=True)
class Completion:
    text: str
    result: GenerationResult
    prompt_ids: tuple[int, ...]


def _load_draft(spec: Optional[str], target: LoadedModel, config: EngineConfig) -> LoadedModel:
    """spec None: the draft shipped for the target (made by `specdec train draft`). A specdec draft
    directory loads onto the target's embeddings; anything else is a plain model directory that
    must share the target's vocabulary."""
    from specdec.drafts import is_draft_dir, load_draft, shipped_draft_path

    name = target.lm.name
    # A draft runs on torch; over a llama.cpp target it shares the GGUF's (dequantized) embeddings.
    backend = "auto" if config.backend == "llamacpp" else config.backend
    if spec is None:
        path = shipped_draft_path(name)
        if path is None:
            raise InvalidRequest(f"no draft is shipped for the target {name!r}: pass --draft DIR (a model sharing "
                                 "its vocabulary, or a draft made by `specdec train draft`)")
        return LoadedModel(lm=load_draft(path, target.lm, target_name=name, backend=backend),
                           tokenizer=target.tokenizer, path=str(path))
    if is_draft_dir(Path(spec)):
        lm = load_draft(Path(spec), target.lm, backend=backend)
        return LoadedModel(lm=lm, tokenizer=target.tokenizer, path=spec)
    draft = load_model(spec, cache_dir=config.cache_dir, backend=backend)
    check_compatible(target, draft)
    return draft


def _prefix_cache(config: EngineConfig) -> Optional[PrefixCache]:
    if config.prefix_cache_mb < 0:
        raise InvalidRequest(f"prefix_cache_mb must be >= 0, got {config.prefix_cache_mb}")
    return PrefixCache(config.prefix_cache_mb << 20) if config.prefix_cache_mb else None


def _history(config: EngineConfig) -> Optional[TokenHistory]:
    if config.history_tokens < 0:
        raise InvalidRequest(f"history_tokens must be >= 0, got {config.history_tokens}")
    return TokenHistory(config.history_tokens) if config.history_tokens else None


def default_cost_store(config: EngineConfig, refresh: bool = False,
                       notify: Optional[Callable[[str], None]] = None) -> CostStore:
    """The engine's costs, kept in config.cost_cache (default: the user's cache folder)."""
    if config.cost_cache is None:
        return user_cost_store(refresh, notify)
    return CostStore(config.cost_cache, refresh, notify)


class Engine:
    """costs: where automatic choices (k auto, the Medusa tree) get this machine's measured
    costs (default: kept in the user's cache folder, see default_cost_store)."""

    def __init__(self, config: EngineConfig = EngineConfig(), costs: Optional[CostStore] = None):
        self.config = config
        self.costs = costs or default_cost_store(config)
        if config.backend == "auto":
            from specdec.backends.choice import load_fastest

            self.target: LoadedModel = load_fastest(config.target, config.methods, self.costs, config.cache_dir)
        else:
            self.target = load_model(config.target, cache_dir=config.cache_dir, backend=config.backend,
                                     costs=self.costs)
        self.draft: Optional[LoadedModel] = None
        if config.draft is not None:
            self.draft = _load_draft(config.draft, self.target, config)
        self._factories: dict[str, ProposerFactory] = {}
        self.prefix_cache = _prefix_cache(config)
        self.history, self.history_acceptance = _history(config), MatchAcceptance()

    @classmethod
    def from_models(cls, target: LoadedModel, draft: Optional[LoadedModel] = None,
                    config: EngineConfig = EngineConfig(), costs: Optional[CostStore] = None) -> "Engine":
        """An engine over models already loaded (e.g. by the benchmark, on a chosen backend)."""
        engine = cls.__new__(cls)
        engine.config = config
        engine.costs = costs or default_cost_store(config)
        engine.target = target
        engine.draft = draft
        engine._factories = {}
        engine.prefix_cache = _prefix_cache(config)
        engine.history, engine.history_acceptance = _history(config), MatchAcceptance()
        if draft is not None:
            check_compatible(target, draft)
        return engine

    @property
    def backend(self) -> str:
        """The backend the target runs on ("auto" resolved): llamacpp, fast or hf."""
        return self.target.lm.backend

    def require_draft(self) -> LoadedModel:
        """The configured draft, else (loaded once) the draft shipped for the target."""
        if self.draft is None:
            self.draft = _load_draft(None, self.target, self.config)
        return self.draft

    def proposer_factory(self, method: str) -> Optional[ProposerFactory]:
        """The method's proposer factory (None for plain), loaded on first use and kept: loading
        is what fails on a missing model, and what is worth doing once (Medusa's heads)."""
        if method == PLAIN:
            return None
        if method not in self._factories:
            env = ProposerEnv(self.target.lm, self.config, self.costs, lambda: self.require_draft().lm,
                              gives_features=True)  # speculative_generate hands proposers the features
            self._factories[method] = load_proposer(method, env)
        return self._factories[method]

    def resolve_method(self, method: str) -> str:
        """method as given, or for "auto": the method the cost model predicts fastest from the
        target's measured verify cost (costmodel.choose_method), if it clears the margin, else
        plain: prompt lookup at its acceptance in earlier runs here (a half until it has run),
        and the draft, EAGLE and eagle-lookup once they have run here (their measured acceptance
        and cost c). Their k auto then follows each row's real acceptance. On a compute-bound
        backend (llama.cpp on a CPU: a forward over k tokens costs ~k single steps) speculation
        cannot pay and auto never probes for it."""
        if method != AUTO:
            return method
        lm = self.target.lm
        v = self.costs.verify_cost(lm)
        lookup = self.costs.acceptance(lm, "prompt-lookup")
        candidates = {"prompt-lookup": (AUTO_ALPHA if lookup is None else lookup, 0.0)}
        draft_alpha = self.costs.acceptance(lm, "draft", self._proposer_name("draft"))
        if draft_alpha is not None:  # the draft has run here before: its measured acceptance and cost
            candidates["draft"] = (draft_alpha, self.costs.draft_cost(self.require_draft().lm, lm))
        for name in ("eagle", "eagle-lookup"):  # so has the EAGLE draft: its acceptance, and its step's cost
            alpha = self.costs.acceptance(lm, name, self._proposer_name(name))
            if alpha is not None:
                candidates[name] = (alpha, self._eagle_cost())
        return choose_method(v, candidates)

    def _eagle_cost(self) -> float:
        """c of the EAGLE draft on this target and machine (specdec.eagle.step_cost), kept in the store."""
        from specdec.proposers.eagle import eagle_cost

        draft = self.proposer_factory("eagle")().draft  # the draft the method loaded (once)
        return eagle_cost(self.costs, draft, self.target.lm, self.config.eagle_dir)

    def _proposer_name(self, method: str) -> str:
        """What a method's acceptance record is kept under beside the method (its draft, heads or
        EAGLE directory as configured; "" for the shipped one)."""
        return {"draft": self.config.draft, "medusa": self.config.medusa_heads,
                "eagle": self.config.eagle_dir, "eagle-lookup": self.config.eagle_dir}.get(method) or ""

    def k_schedule(self, method: str, k: "KSchedule | int | str") -> KSchedule | int:
        """k as given, or for "auto": for draft, prompt-lookup, eagle and eagle-lookup, the
        cost-aware schedule from this machine's measured verify cost and draft cost (self.costs),
        starting for EAGLE's from its acceptance measured here (so a row whose drafts do not pay
        runs plain steps, its draft idle, with a probe now and then; within k EAGLE's depth still
        follows its confidence); for the others (whose k only bounds the depth of their own
        proposals) 4."""
        if k != "auto":
            if isinstance(k, str):
                raise InvalidRequest(f"k must be a positive integer or 'auto', got {k!r}")
            return k
        lm = self.target.lm
        if method in ("eagle", "eagle-lookup"):
            alpha = self.costs.acceptance(lm, method, self._proposer_name(method))
            return KSchedule.cost_aware(self.costs.verify_cost(lm), self._eagle_cost(),
                                        prior_alpha=0.5 if alpha is None else alpha)
        if method not in ("draft", "prompt-lookup"):
            return 4
        c = self.costs.draft_cost(self.require_draft().lm, lm) if method == "draft" else 0.0
        return KSchedule.cost_aware(self.costs.verify_cost(lm), c)

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        if not prompt.strip():
            raise InvalidRequest("the prompt is empty")
        if self.target.tokenizer is None:
            raise InvalidRequest(f"the target {self.target.path} has no tokenizer: pass token ids instead of text")
        return format_prompt(self.target.tokenizer, prompt, chat=chat)

    def decode(self, ids: Sequence[int]) -> str:
        return self.target.tokenizer.decode(list(ids), skip_special_tokens=True)

    def generate_ids(self, prompts: Sequence[Sequence[int]], method: str = "plain",
                     sampling: SamplingParams = SamplingParams(), stop: StopConditions = StopConditions(),
                     k: KSchedule | int | str = 4, on_emit: Optional[OnEmit] = None) -> list[GenerationResult]:
        """k: a number, a KSchedule, or "auto" (see k_schedule); on_emit(row, tokens): each row's
        tokens as they are committed."""
        if method != AUTO and method not in method_names():
            raise InvalidRequest(f"unknown method {method!r}; choose one of {AUTO}, {', '.join(method_names())}")
        method = self.resolve_method(method)
        k = self.k_schedule(method, k)
        if not stop.eos_token_ids:
            stop = StopConditions(stop.max_new_tokens, self.target.lm.eos_token_ids, stop.stop_strings)
        detok = self.decode if stop.stop_strings else None
        factory = self.proposer_factory(method)
        if factory is None:
            return self._plain(prompts, sampling, stop, detok, on_emit)
        results = speculative_generate(self.target.lm, factory(), prompts, sampling, stop, k=k, detokenize=detok,
                                       on_emit=on_emit, prefix_cache=self.prefix_cache)
        # what `auto` reads next time: this method's acceptance on the prompts users send
        self.costs.add_acceptance(self.target.lm, method, sum(r.stats.drafted for r in results),
                                  sum(r.stats.accepted for r in results), self._proposer_name(method))
        return results

    def _plain(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, stop: StopConditions,
               detok, on_emit: Optional[OnEmit]) -> list[GenerationResult]:
        """Plain decoding; where the engine keeps a history, drafting what earlier calls said after
        the same tokens (greedy or unseeded sampling: token_history.drafts_for), then keeping this
        call's prompts and answers in it."""
        lm = self.target.lm
        if not self.history or not drafts_for(sampling):  # (None, or nothing kept yet)
            results = plain_generate(lm, prompts, sampling, stop, detokenize=detok, on_emit=on_emit,
                                     prefix_cache=self.prefix_cache)
        else:
            proposer = HistoryProposer(self.history, self.costs.verify_cost(lm), self.history_acceptance)
            results = speculative_generate(lm, proposer, prompts, sampling, stop, k=MAX_DRAFT, detokenize=detok,
                                           on_emit=on_emit, prefix_cache=self.prefix_cache)
        if self.history is not None:
            for prompt, result in zip(prompts, results):
                self.history.add([*prompt, *result.token_ids])
        return results

    def complete(self, prompt: str, method: str = "plain", sampling: SamplingParams = SamplingParams(),
                 stop: StopConditions = StopConditions(), k: KSchedule | int | str = 4,
                 chat: bool = True, on_text: Optional[Callable[[str], None]] = None) -> Completion:
        """on_text(piece): the answer's text as it is accepted, in pieces that together are
        exactly Completion.text (an incomplete character or a possible stop string is held back)."""
        ids = self.encode(prompt, chat=chat)
        stream = TextStream(self.decode, stop.stop_strings) if on_text is not None else None

        def emit(row: int, tokens: Sequence[int]) -> None:
            piece = stream.push(tokens)
            if piece:
                on_text(piece)

        result = self.generate_ids([ids], method, sampling, stop, k, on_emit=emit if stream else None)[0]
        text = cut_at_stop_string(self.decode(result.token_ids), stop.stop_strings)
        if stream is not None:
            rest = stream.finish()
            if rest:
                on_text(rest)
        return Completion(text=text, result=result, prompt_ids=tuple(ids))
