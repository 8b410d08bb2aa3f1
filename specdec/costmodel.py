"""The arithmetic of speculative decoding, and the one machine measurement it needs.

- `expected_tokens(alpha, k)`: emitted tokens per target forward when each of k drafted tokens
  is accepted with probability alpha, independently, until the first rejection (Leviathan et al.
  2023): E = (1 - alpha^(k+1)) / (1 - alpha), bonus token included.
- `predicted_speedup(alpha, k, c, v)`: E / (k*c + v(k+1)) over plain decoding, where c is the
  cost of drafting one token relative to one target decode step and v(m) is the cost of a target
  forward over m new tokens relative to one over a single token (the verify-cost curve).
- `measure_verify_cost(lm, ks)`: v(k) on this machine, through the same `forward` the engine
  uses, against a warm cache of `context_len` tokens.

On a GPU at batch 1, v is ~1 for small k; on a CPU it is not (SmolLM2-135M on 2 cores: v(4) ~1.4,
v(8) ~1.7, see specdec/proposers/lookahead.py), which is why proposers
pick k, tree size or window from the measured curve rather than from a constant.

Limitation: the i.i.d. acceptance model overestimates E when acceptances are correlated
(they usually are: a draft that is wrong once tends to stay wrong), so treat predictions as an
upper bound for ranking choices, not a promise.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import platform
import statistics
import time
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

import torch

VerifyCost = Union[Mapping[int, float], Callable[[int], float]]


def expected_tokens(alpha: float, k: int) -> float:
    """Expected emitted tokens per target forward with k drafted tokens at acceptance rate alpha."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def verify_cost_at(v: VerifyCost, m: int) -> float:
    """v(m) from a measured curve (dict) or a function. Between measured points the cost is
    interpolated linearly; beyond the last point it is extrapolated from the last two."""
    if callable(v):
        return float(v(m))
    if m in v:
        return float(v[m])
    keys = sorted(v)
    if not keys:
        raise ValueError("empty verify-cost curve")
    if m < keys[0]:
        return float(v[keys[0]])
    lo = max((x for x in keys if x < m), default=keys[0])
    hi = min((x for x in keys if x > m), default=None)
    if hi is None:  # extrapolate
        if len(keys) == 1:
            return float(v[keys[0]])
        a, b = keys[-2], keys[-1]
        return float(v[b] + (v[b] - v[a]) * (m - b) / (b - a))
    return float(v[lo] + (v[hi] - v[lo]) * (m - lo) / (hi - lo))


def predicted_speedup(alpha: float, k: int, c: float, v: VerifyCost) -> float:
    """Speedup over plain decoding: E(alpha, k) / (k*c + v(k+1)).

    c: draft cost per drafted token / target cost per decode step (0 for prompt lookup,
    Medusa heads or Lookahead, whose proposals ride in the verification forward);
    v: the verify-cost curve, v(1) == 1.
    """
    if c < 0:
        raise ValueError(f"c must be >= 0, got {c}")
    return expected_tokens(alpha, k) / (k * c + verify_cost_at(v, k + 1))


def block_rate(reach: Sequence[float], c: float, v: VerifyCost) -> float:
    """Expected emitted tokens per time (in target steps) of a block of the len(reach) drafted
    tokens, reach[d] the estimated chance that its first d + 1 are all accepted: (1 + sum(reach))
    / (n*c + v(n + 1)). An empty block (a plain step) is worth 1 / v(1)."""
    return (1.0 + sum(reach)) / (len(reach) * c + verify_cost_at(v, len(reach) + 1))


def tokens_worth_verifying(reach: Sequence[float], c: float, v: VerifyCost) -> int:
    """How many of a drafted chain's tokens to verify: the n maximizing block_rate(reach[:n], c, v)
    (reach non-increasing; 0: a plain step). The smallest n on ties. c: as in predicted_speedup
    (the drafting is charged for the n tokens kept)."""
    rates = [block_rate(reach[:n], c, v) for n in range(len(reach) + 1)]
    return max(range(len(rates)), key=lambda n: (rates[n] - 1e-12 * n, -n))


def worth_including(reach: Sequence[float], k: int, c: float, v: VerifyCost) -> bool:
    """Whether a chain's last token so far (reach as in tokens_worth_verifying, up to it) belongs
    in a block of at most k tokens, judged from the chain up to it only: if every later token
    were as likely as it (the most they can be), the best block would hold it. A rule that reads
    nothing of the tokens after it, so a sampled chain cut by it stays exact."""
    if not reach or len(reach) > k:
        return False
    filled = [*reach, *[reach[-1]] * (k - len(reach))]
    return tokens_worth_verifying(filled, c, v) >= len(reach)


def best_k(alpha: float, c: float, v: VerifyCost, ks: Iterable[int] = range(1, 33)) -> int:
    """The k in ks with the highest predicted speedup (smallest k on ties)."""
    ks = list(ks)
    if not ks:
        raise ValueError("no k to choose from")
    return max(ks, key=lambda k: (predicted_speedup(alpha, k, c, v), -k))


# The acceptance rate at which `auto` asks whether target-local speculation (prompt lookup) can
# pay (prompt lookup's on the dev prompts was 0.49 on the fast backend).
AUTO_ALPHA = 0.5


# How much better than plain the prediction must be: prompt lookup's acceptance on chat, code and
# qa prompts is 0.1-0.3, not AUTO_ALPHA, and at a predicted 1.04x (llama.cpp, v(2) = 1.44) it ran
# at 0.65x plain through the target service (specdec/bench/serve.py, 2 threads).
AUTO_MARGIN = 1.15


def choose_method(v: VerifyCost, candidates: Mapping[str, tuple[float, float]]) -> str:
    """Of the candidates (method -> (acceptance rate alpha, draft cost per token c relative to a
    target forward)), the one whose predicted speedup at its best k is highest, if it clears
    AUTO_MARGIN; else plain."""
    best, best_speedup = "plain", AUTO_MARGIN
    for name, (alpha, c) in sorted(candidates.items()):
        speedup = predicted_speedup(alpha, best_k(alpha, c, v, range(1, 9)), c, v)
        if speedup >= best_speedup:
            best, best_speedup = name, speedup
    return best


def target_local_method(v: VerifyCost, alpha: Optional[float] = None) -> str:
    """What `auto` runs on the target alone, from its verify-cost curve: prompt lookup (k auto)
    where a draft right `alpha` of the time (its measured acceptance; AUTO_ALPHA, a half, until
    measured) would pay clearly (AUTO_MARGIN), else plain (a compute-bound backend: llama.cpp on
    a CPU, where a forward over k tokens costs ~k single steps). One rule for the in-process
    engine and the target service."""
    return choose_method(v, {"prompt-lookup": (AUTO_ALPHA if alpha is None else alpha, 0.0)})


def acceptance_can_pay(v: VerifyCost, alpha: float) -> bool:
    """Whether a draft right `alpha` of the time could beat plain decoding on this verify cost by
    the margin if drafting cost nothing (c 0, its best k): the most any draft at that acceptance
    could gain. False: not worth even a try."""
    return choose_method(v, {"a free draft": (alpha, 0.0)}) != "plain"


def acceptance_upper_bound(accepted: float, judged: float, z: float = 1.645) -> float:
    """A one-sided upper confidence bound on the acceptance rate after `accepted` of `judged`
    drafted tokens were accepted (Wilson's score bound; z 1.645: 95%); 1 before any was judged.
    Two rejections already bound it below 0.6, so a draft that cannot pay is known quickly."""
    if judged <= 0:
        return 1.0
    p, z2 = min(max(accepted / judged, 0.0), 1.0), z * z
    centre = p + z2 / (2 * judged)
    spread = z * math.sqrt(p * (1 - p) / judged + z2 / (4 * judged * judged))
    return min(1.0, (centre + spread) / (1 + z2 / judged))


def speculation_can_pay(v: VerifyCost) -> bool:
    """Whether any draft could beat plain decoding on this verify cost by the margin: a free draft
    that is always right (alpha 1, c 0) at its best k. Not on llama.cpp on a CPU, where a forward
    over k tokens costs ~k single steps: there nothing need be tried."""
    return acceptance_can_pay(v, 1.0)


# The drafted tokens an acceptance record keeps the weight of: older ones fade, so the figure
# follows the prompts a user sends now, yet one short request does not swing it.
ACCEPTANCE_WINDOW = 4096


def _timed_forward(lm, cache, ids: torch.Tensor, clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds for one forward over ids [1, k] on top of the cache; the new slots are dropped again."""
    q = ids.shape[1]
    t0 = clock()
    out = lm.forward(cache, ids)
    out.logits.sum().item()  # make sure the work is done (also on asynchronous devices)
    if lm.device.type == "cuda":
        torch.cuda.synchronize()
    dt = clock() - t0
    cache.keep_last(torch.zeros(1, q, dtype=torch.bool))
    return dt


def thread_cpu_time_applies(lm) -> bool:
    """Whether the calling thread's CPU time measures `lm`'s work: torch runs one thread and the
    model is on the CPU. Such a measure is disturbed far less than wall time by other processes
    on a shared machine."""
    return torch.get_num_threads() == 1 and lm.device.type == "cpu"


def timer(cpu_time: bool) -> Callable[[], float]:
    return time.thread_time if cpu_time else time.perf_counter


def measure_forward_times(lm, ks: Iterable[int] = range(1, 65), context_len: int = 256, repeats: int = 5,
                          warmup: int = 2, seed: int = 0, progress: Optional[Callable[[int, float], None]] = None,
                          cpu_time: bool = False) -> tuple[dict[int, float], float]:
    """Median seconds of a forward over k new tokens, for every k in ks, and of one over 1 token
    (timed interleaved with every k so drift hits both alike), each run through `lm.forward`
    against a warm cache of `context_len` random tokens. Returns ({k: seconds}, seconds for 1).
    cpu_time: time the calling thread's CPU time instead of wall time (with 1 torch thread, a
    measure that other processes on a shared machine disturb far less)."""
    clock = timer(cpu_time)
    ks = sorted(set(int(k) for k in ks))
    if not ks or ks[0] < 1:
        raise ValueError("ks must be positive integers")
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    if context_len < 1 or context_len + max(ks) > lm.max_positions:
        raise ValueError(f"context_len {context_len} + k {max(ks)} must fit in {lm.max_positions} positions")
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, lm.vocab_size, (context_len,), generator=gen).tolist()
    cache = lm.new_cache(1)
    lm.prefill(cache, [prompt])
    one = torch.randint(0, lm.vocab_size, (1, 1), generator=gen)
    for _ in range(warmup):
        _timed_forward(lm, cache, one, clock)
        _timed_forward(lm, cache, torch.randint(0, lm.vocab_size, (1, max(ks)), generator=gen), clock)
    times: dict[int, float] = {}
    t1_all: list[float] = []
    for k in ks:
        ids = torch.randint(0, lm.vocab_size, (1, k), generator=gen)
        t1, tk = [], []
        for _ in range(repeats):
            t1.append(_timed_forward(lm, cache, one, clock))
            tk.append(_timed_forward(lm, cache, ids, clock))
        t1_all += t1
        times[k] = statistics.median(t1) if k == 1 else statistics.median(tk)
        if progress is not None:
            progress(k, times[k] / statistics.median(t1))
    return times, statistics.median(t1_all)


def measure_verify_cost(lm, ks: Iterable[int] = range(1, 65), context_len: int = 256, repeats: int = 5,
                        warmup: int = 2, seed: int = 0, progress: Optional[Callable[[int, float], None]] = None,
                        cpu_time: bool = False) -> dict[int, float]:
    """v(k) = median time of a forward over k new tokens / median time of a forward over 1, each
    run through `lm.forward` against a warm cache of `context_len` tokens (random token ids).

    Each k is normalised by the 1-token forwards timed alongside it, so slow drift cancels.
    Returns {k: v(k)} for every k in ks (v(1) == 1.0 when 1 is in ks).
    """
    curve: dict[int, float] = {}

    def record(k: int, v: float) -> None:
        curve[k] = 1.0 if k == 1 else v
        if progress is not None:
            progress(k, curve[k])

    measure_forward_times(lm, ks, context_len, repeats, warmup, seed, progress=record, cpu_time=cpu_time)
    return curve


QUICK_SIZES = (1, 2, 3, 5, 9, 17)
WIDE_SIZES = (33, 65)  # measured too when the curve is still flat at 17 (a GPU)


def quick_verify_cost(lm) -> dict[int, float]:
    """v(k) for a few sizes (~40 forwards against a short context; interpolated between sizes).
    Thread CPU time when torch runs one thread (far less disturbed by other processes), else
    wall time. Measures every call: `CostStore.verify_cost` keeps the result."""
    cpu_time = thread_cpu_time_applies(lm)
    curve = measure_verify_cost(lm, ks=QUICK_SIZES, context_len=64, repeats=3, warmup=1, cpu_time=cpu_time)
    if curve[QUICK_SIZES[-1]] < 1.5 and 64 + WIDE_SIZES[-1] <= lm.max_positions:
        wide = measure_verify_cost(lm, ks=(1, *WIDE_SIZES), context_len=64, repeats=3, warmup=1, cpu_time=cpu_time)
        curve.update({k: wide[k] for k in WIDE_SIZES})
    # A forward over more tokens never costs less: keep the running maximum, so that timing
    # noise at one size cannot make a larger tree look cheaper than a smaller one.
    running = 0.0
    for k in sorted(curve):
        running = curve[k] = max(running, curve[k])
    return curve


def quick_draft_cost(draft, target) -> float:
    """c = the draft's time for a 1-token forward / the target's, against short contexts (same
    clock rule as quick_verify_cost). Measures every call: `CostStore.draft_cost` keeps it."""
    cpu_time = thread_cpu_time_applies(target)
    t_draft = measure_forward_times(draft, ks=(1,), context_len=64, repeats=7, warmup=2, cpu_time=cpu_time)[1]
    t_target = measure_forward_times(target, ks=(1,), context_len=64, repeats=7, warmup=2, cpu_time=cpu_time)[1]
    return t_draft / t_target


TYPICAL_PROMPT_TOKENS = 128
TYPICAL_NEW_TOKENS = 128  # `specdec generate`'s default


def measure_request_seconds(lm, prompt_tokens: int = TYPICAL_PROMPT_TOKENS, new_tokens: int = TYPICAL_NEW_TOKENS,
                            steps: int = 16, repeats: int = 3, cpu_time: bool = False) -> dict[str, float]:
    """What a typical greedy request costs on `lm`, through the engine's interface: the median
    seconds to prefill `prompt_tokens` random tokens, the median seconds of a 1-token decode step
    right after (over `steps` steps), and their sum for a request of `new_tokens` new tokens.
    -> {"prefill_s", "step_s", "request_s"}. The first repeat warms up and is not counted."""
    clock = timer(cpu_time)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, lm.vocab_size, (prompt_tokens,), generator=gen).tolist()
    prefills, step_times = [], []
    for rep in range(repeats + 1):
        cache = lm.new_cache(1)
        t0 = clock()
        out = lm.prefill(cache, [prompt])
        prefill_s = clock() - t0
        token = int(out.logits[0].argmax())
        for _ in range(steps):
            t0 = clock()
            out = lm.forward(cache, torch.tensor([[token]]))
            token = int(out.logits[0, -1].argmax())
            if rep:
                step_times.append(clock() - t0)
        if rep:
            prefills.append(prefill_s)
        del cache
    prefill_s, step_s = statistics.median(prefills), statistics.median(step_times)
    return {"prefill_s": prefill_s, "step_s": step_s, "request_s": prefill_s + new_tokens * step_s}


@functools.lru_cache(maxsize=None)  # (read once a process: resolve_method asks per request)
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=None)  # (importlib.metadata parses a package's METADATA file each call: ~1 ms)
def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


def machine_identity(device: torch.device) -> dict:
    """What a measured cost depends on besides the model: the processor (and accelerator), the
    libraries that run the forward, and the threads torch uses."""
    ident = {"cpu": cpu_model(), "cpus": os.cpu_count(), "arch": platform.machine(),
             "torch": torch.__version__, "transformers": _version("transformers"), "specdec": _version("specdec"),
             "threads": torch.get_num_threads()}
    if device.type == "cuda":
        ident["accelerator"] = torch.cuda.get_device_name(device)
    return ident


# A device where a forward over up to 64 tokens costs one one-token forward (a GPU at batch 1,
# roughly; `bench/gpu.sh` measures the real curve): `specdec bench --verify-cost flat`.
FLAT_VERIFY_COST: dict[int, float] = {1: 1.0, 64: 1.0}


class CostStore:
    """The cost figures that automatic choices need (v(k) for k auto and the Medusa tree, the
    draft cost c), measured once per machine, model, backend and thread count, then reused.

    Kept in memory for the process and, with `directory`, as one small JSON file per figure for
    later processes (`specdec cost-curve --refresh` measures them again). A figure is reused
    only when everything it depends on is unchanged: its file holds the full key (processor,
    library versions, torch threads, each model's `cost_identity()`: implementation, dtype,
    device, weights), and a file whose key differs is measured again and overwritten.
    `notify(line)` is told before each measurement (a few seconds to a minute on a CPU).

    A timing taken while other processes kept more than `busy_limit` CPUs busy (a training run, a
    test suite, another server) says little about the machine when it serves: such a figure is
    used by this process only and measured again by the next one (`others_busy` reads the load).
    """

    def __init__(self, directory: Optional[Path] = None, refresh: bool = False,
                 notify: Optional[Callable[[str], None]] = None, busy_limit: float = 0.25,
                 others_busy: Optional[Callable[[Callable[[], object]], tuple[object, float]]] = None):
        self.directory = None if directory is None else Path(directory)
        self.refresh = refresh
        self.notify = notify
        self.busy_limit = busy_limit
        self.others_busy = others_busy or measure_with_others_busy
        self._memory: dict[str, object] = {}

    def verify_cost(self, lm) -> dict[int, float]:
        key = {"figure": "verify_cost", "sizes": [QUICK_SIZES, WIDE_SIZES], "machine": machine_identity(lm.device),
               "model": lm.cost_identity()}
        got = self._get(key, f"the verify cost of {lm.name}", lambda: quick_verify_cost(lm))
        return {int(k): float(v) for k, v in dict(got).items()}

    def draft_cost(self, draft, target) -> float:
        key = {"figure": "draft_cost", "machine": machine_identity(target.device), "draft": draft.cost_identity(),
               "model": target.cost_identity()}
        return float(self._get(key, f"the draft's cost against the target {target.name}",
                               lambda: quick_draft_cost(draft, target)))

    def acceptance(self, target, method: str, proposer: str = "") -> Optional[float]:
        """The acceptance rate `method` (with `proposer`: its draft or heads, by path) has had on
        this target (a model, or its name) in earlier runs (add_acceptance), or None before any
        drafted token. Not a timing: it depends on the models and the prompts, not on the machine."""
        got = self.acceptance_counts(target, method, proposer)
        return None if got is None else got[1] / got[0]

    def acceptance_counts(self, target, method: str, proposer: str = "") -> Optional[tuple[float, float]]:
        """The (faded) drafted and accepted token counts behind acceptance(), or None before any."""
        got = self._acceptance(self._acceptance_key(target, method, proposer))
        return None if got is None or got[0] <= 0 else got

    def add_acceptance(self, target, method: str, drafted: int, accepted: int, proposer: str = "") -> None:
        """Count a run's drafted and accepted tokens in (the oldest fading beyond ACCEPTANCE_WINDOW)."""
        if drafted <= 0:
            return
        key = self._acceptance_key(target, method, proposer)
        old_drafted, old_accepted = self._acceptance(key) or (0.0, 0.0)
        total, hits = old_drafted + drafted, old_accepted + accepted
        if total > ACCEPTANCE_WINDOW:
            total, hits = ACCEPTANCE_WINDOW, hits * ACCEPTANCE_WINDOW / total
        self._memory[_key_digest(key)] = [total, hits]
        path = self.path_for(key)
        if path is not None:
            _write_figure(path, key, [total, hits])

    @staticmethod
    def _acceptance_key(target, method: str, proposer: str) -> dict:
        return {"figure": "acceptance", "target": getattr(target, "name", target), "method": method,
                "proposer": proposer}

    def _acceptance(self, key: dict) -> Optional[tuple[float, float]]:
        digest = _key_digest(key)
        if digest not in self._memory:
            path = self.path_for(key)
            self._memory[digest] = None if path is None else _read_figure(path, key)
        got = self._memory[digest]
        return None if got is None else (float(got[0]), float(got[1]))

    def figure(self, key: dict, what: str, measure: Callable[[], object], timed: bool = True):
        """Any other figure (JSON-serialisable), kept under `key` like the ones above; `key` must
        say everything the figure depends on (use machine_identity) and name it under "figure".
        timed=False: a figure that other processes' load cannot change (a verdict), kept anyway."""
        return self._get(key, what, measure, timed)

    def path_for(self, key: dict) -> Optional[Path]:
        if self.directory is None:
            return None
        return self.directory / f"{key['figure']}-{_key_digest(key)}.json"

    def _get(self, key: dict, what: str, measure: Callable[[], object], timed: bool = True):
        digest = _key_digest(key)
        if digest in self._memory:
            return self._memory[digest]
        path = self.path_for(key)
        value = None if self.refresh or path is None else _read_figure(path, key)
        if value is None:
            if self.notify is not None:
                where = f"; kept in {self.directory}" if path is not None else ""
                self.notify(f"measuring {what} on this machine (a few seconds, once{where})")
            value, busy = self.others_busy(measure) if timed else (measure(), 0.0)
            if busy > self.busy_limit:
                if self.notify is not None:
                    self.notify(f"other processes kept {busy:.1f} CPUs busy while {what} was measured: "
                                "used now, not kept (measured again by the next process)")
            elif path is not None:
                _write_figure(path, key, value)
        self._memory[digest] = value
        return value


def _busy_cpu_seconds() -> Optional[float]:
    """CPU seconds all processes have kept the machine's CPUs busy since boot (/proc/stat: all but
    idle and iowait; a VM's steal time counts, since other guests disturb a timing as much), or
    None where that cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def measure_with_others_busy(measure: Callable[[], object]) -> tuple[object, float]:
    """(measure()'s value, how many CPUs other processes kept busy meanwhile, on average): the
    machine's busy CPU time less this process's own, over the wall time; 0.0 where unknown."""
    t0, busy0, own0 = time.perf_counter(), _busy_cpu_seconds(), sum(os.times()[:2])
    value = measure()
    wall, busy1, own1 = time.perf_counter() - t0, _busy_cpu_seconds(), sum(os.times()[:2])
    if busy0 is None or busy1 is None or wall <= 0:
        return value, 0.0
    return value, max(0.0, (busy1 - busy0) - (own1 - own0)) / wall


def _key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _read_figure(path: Path, key: dict):
    """The figure stored at path under exactly this key, else None (missing, unreadable or stale)."""
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or stored.get("key") != json.loads(json.dumps(key)):
        return None
    return stored.get("value")


def _write_figure(path: Path, key: dict, value) -> None:
    """Atomically (a crash never leaves half a file); a read-only cache folder only costs a re-measure."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "value": value,
                                   "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=1))
        tmp.replace(path)
    except OSError:
        pass


def format_curve(curve: Mapping[int, float], base_ms: Optional[float] = None) -> str:
    """A two-column text table of a verify-cost curve."""
    lines = ["k    v(k)"]
    lines += [f"{k:<4d} {curve[k]:.2f}" for k in sorted(curve)]
    if base_ms is not None:
        lines.append(f"(1-token forward: {base_ms:.1f} ms)")
    return "\n".join(lines)


class AssumedVerifyCost(CostStore):
    """A cost store whose verify cost is a given curve instead of this machine's: every automatic
    choice (k auto, EAGLE's depth and tree, the Medusa tree, eagle-lookup's choice) is made as
    on a device with that curve, so tau and alpha are what that device's run would show (the
    tokens/s are still this machine's). Other figures are measured here, and kept in memory
    only, so nothing learned under the assumption reaches the user's store."""

    def __init__(self, curve: dict[int, float], **kwargs):
        super().__init__(None, **kwargs)
        self.curve = dict(curve)

    def verify_cost(self, lm) -> dict[int, float]:
        return dict(self.curve)
