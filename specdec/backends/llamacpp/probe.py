"""Before llama.cpp first runs in this process on a machine and build, run it in a child process.

llama.cpp is native code compiled on the user's machine (or copied from another one: a venv on
shared storage, a wheel cache, an image layer). A build can crash the process that loads it:
compiled for AMX on a VM that advertises AMX but cannot run it (a general protection fault at
`ldtilecfg`), or for AVX2 on an older CPU (SIGILL). A crash in the calling process would take
`specdec generate`, the target service or pytest down with it, with no message. So the first use
of llama.cpp on a machine, build and GGUF file runs `python -m specdec.backends.llamacpp.probe FILE` in a
child: it loads the model, prefills a fixed prompt (a batched forward: the matrix-matrix kernels),
decodes a few tokens greedily one at a time (the matrix-vector kernels), and scores the same tokens
again in one block. The parent judges what came back (`judge`):

- a child killed by a signal, one that exits with an error, or one that hangs past its deadline;
- the block's greedy tokens disagreeing with the one-token steps' beyond `SELF_TOLERANCE`;
- with a reference (the same model on torch, for the embedded default: the "fast" path), the
  child's greedy tokens disagreeing with the reference's beyond `REFERENCE_TOLERANCE` (a token
  where the reference differs is accepted only while the child's own logits for both are that
  close: quantized arithmetic differs from float32 at near-ties);

each mark llama.cpp unusable. The verdict is kept in the CostStore under the machine (processor
and its CPU feature flags), the llama.cpp build (a digest of its shared libraries: a rebuilt
library is probed again) and the GGUF file, so later runs pay nothing.

`require_usable` raises LlamaCppUnusable with one line (what happened and the command that
rebuilds llama.cpp portably); `--backend auto` catches it and runs the float32 path instead
(specdec.backends.choice), an explicit `--backend llamacpp` exits 2 with it (the CLI's one-line
errors), and the target service refuses to start with it.
"""
from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from specdec.errors import ModelLoadError
from specdec.backends.llamacpp.build import build_identity, cpu_features

PROMPT_TOKENS = 24
GREEDY_STEPS = 8
TOP_N = 8  # candidates reported per position: enough to find the reference's token at a near-tie
SELF_TOLERANCE = 1.0  # logits: a k-token block and 1-token steps round differently on llama.cpp
REFERENCE_TOLERANCE = 1.5  # logits: Q4/Q8 kernels against the float32 weights of the same model
DEADLINE_S = 120.0  # the child's whole run (a 135M model: ~2 s)

REBUILD = ("rebuild llama.cpp portably: SPECDEC_LLAMA_CPU=x86-64-v3 SPECDEC_LLAMA_AMX=0 bash scripts/bootstrap.sh "
           "(SPECDEC_LLAMA_CPU=generic on a CPU without AVX2; outside a checkout: CMAKE_ARGS=\"-DGGML_NATIVE=OFF "
           "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF\" pip install --force-reinstall --no-deps "
           "--no-cache-dir llama-cpp-python), or use --backend fast")


class LlamaCppUnusable(ModelLoadError):
    """llama.cpp crashed, hung or computed wrong tokens in its probe on this machine and build."""


@dataclass(frozen=True)
class ChildRun:
    """What the probe child did: its exit status (negative: killed by that signal), its output,
    and whether it was stopped at its deadline."""

    returncode: int
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False


@dataclass(frozen=True)
class Verdict:
    ok: bool
    detail: str  # what happened, one line


def probe_prompt(vocab_size: int, n: int = PROMPT_TOKENS) -> list[int]:
    """A fixed prompt of n token ids spread over the vocabulary (no tokenizer needed)."""
    return [(7919 * i + 104729) % vocab_size for i in range(1, n + 1)]


def _top(logits, n: int = TOP_N) -> list[list[float]]:
    values, ids = logits.float().topk(min(n, logits.numel()))
    return [[int(i), float(v)] for i, v in zip(ids.tolist(), values.tolist())]


def run_in_child(path: Path, steps: int = GREEDY_STEPS, threads: Optional[int] = None) -> dict:
    """The child's work (in this process: call it only from the child): -> what `judge` reads."""
    import torch

    from specdec.backends.llamacpp.model import LlamaCppLM

    lm = LlamaCppLM(path, threads=threads, context=PROMPT_TOKENS + steps + 8)
    prompt = probe_prompt(lm.vocab_size)
    cache = lm.new_cache(1)
    logits = lm.prefill(cache, [prompt]).logits[0]  # the batched (matrix-matrix) kernels
    greedy, tops = [], []
    for _ in range(steps):  # one token at a time (matrix-vector kernels)
        tops.append(_top(logits))
        greedy.append(int(logits.argmax()))
        logits = lm.forward(cache, torch.tensor([[greedy[-1]]])).logits[0, -1]
    block = lm.forward(lm.new_cache(1), torch.tensor([prompt + greedy[:-1]])).logits[0, len(prompt) - 1:]
    return {"vocab_size": lm.vocab_size, "prompt": prompt, "greedy": greedy, "top": tops,
            "block_top": [_top(row) for row in block]}


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def _logit(top: Sequence[Sequence[float]], token: int) -> Optional[float]:
    return next((v for i, v in top if int(i) == token), None)


def _first_disagreement(tops: Sequence, want: Sequence[int], tolerance: float) -> Optional[str]:
    """Where tokens `want` (one per position) leave the candidates `tops` beyond `tolerance`
    (its logit more than `tolerance` below the best there, or not among the candidates); None if
    they agree. After a tolerated difference the sequences part, so nothing later is compared."""
    for j, (top, token) in enumerate(zip(tops, want)):
        best_id, best = int(top[0][0]), float(top[0][1])
        if best_id == token:
            continue
        got = _logit(top, token)
        if got is None or best - got > tolerance:
            gap = "not among its top candidates" if got is None else f"{best - got:.2f} below its best"
            return f"position {j}: token {token} is {gap} ({best_id})"
        return None
    return None


def judge(run: ChildRun, reference: Optional[Sequence[int]] = None, deadline_s: float = DEADLINE_S) -> Verdict:
    """The verdict on one probe child (pure: see the module docstring)."""
    if run.timed_out:
        return Verdict(False, f"the llama.cpp probe hung: no answer within {deadline_s:.0f} s")
    last = (run.stderr.strip().splitlines() or [""])[-1][:300]
    if run.returncode < 0:
        return Verdict(False, f"the llama.cpp probe was killed by {_signal_name(run.returncode)}"
                              + (f" ({last})" if last else ""))
    if run.returncode != 0:
        return Verdict(False, f"the llama.cpp probe exited with code {run.returncode}" + (f": {last}" if last else ""))
    try:
        out = json.loads(run.stdout.strip().splitlines()[-1])
        greedy, tops, block = list(out["greedy"]), out["top"], out["block_top"]
        if not greedy or len(tops) != len(greedy) or len(block) != len(greedy):
            raise ValueError("lengths differ")
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        return Verdict(False, f"the llama.cpp probe printed no result ({exc})")
    wrong = _first_disagreement(block, greedy, SELF_TOLERANCE)
    if wrong is not None:
        return Verdict(False, f"llama.cpp computes wrong logits: a batched forward disagrees with one-token steps at "
                              f"{wrong}")
    if reference is not None:
        wrong = _first_disagreement(tops, list(reference)[:len(greedy)], REFERENCE_TOLERANCE)
        if wrong is not None:
            return Verdict(False, f"llama.cpp computes wrong tokens: its greedy decoding disagrees with the float32 "
                                  f"model at {wrong}")
    return Verdict(True, f"greedy tokens {greedy} agree" + (" with the float32 model" if reference is not None else ""))


def spawn_child(path: Path, deadline_s: float = DEADLINE_S, argv: Optional[Sequence[str]] = None) -> ChildRun:
    """`python -m specdec.backends.llamacpp.probe FILE` (or `argv`), killed at the deadline."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}  # a crash: its signal, no traceback
    argv = list(argv) if argv is not None else [sys.executable, "-m", "specdec.backends.llamacpp.probe", str(path)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=deadline_s, env=env,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        return ChildRun(returncode=-9, stdout=_text(exc.stdout), stderr=_text(exc.stderr), timed_out=True)
    return ChildRun(done.returncode, done.stdout, done.stderr)


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def probe_key(path: Path) -> dict:
    from specdec.costmodel import cpu_model
    from specdec.backends.llamacpp.model import gguf_identity

    return {"figure": "llamacpp_probe", "cpu": cpu_model(), "cpu_features": cpu_features(),
            "arch": platform.machine(), "gguf": gguf_identity(Path(path))}


def probe(path: Path, costs, reference: Optional[Callable[[list[int], int], list[int]]] = None,
          spawn: Callable[[Path], ChildRun] = spawn_child) -> Verdict:
    """The verdict for llama.cpp on this machine, build and GGUF file: kept in `costs` (a
    CostStore), else measured by `spawn` (a child process) and judged. reference(prompt, n): the
    same model's greedy tokens on another backend (None: only the child's own consistency)."""

    def measure() -> dict:
        run = spawn(Path(path))
        want = None
        if reference is not None and run.returncode == 0 and not run.timed_out:
            try:
                prompt = json.loads(run.stdout.strip().splitlines()[-1])["prompt"]
                want = reference(list(prompt), GREEDY_STEPS)
            except (ValueError, KeyError, IndexError):
                pass  # judge() reports the malformed output
        verdict = judge(run, want)
        return {"ok": verdict.ok, "detail": verdict.detail}

    got = costs.figure(probe_key(path), "whether llama.cpp runs correctly here (a child process)", measure, timed=False)
    if not isinstance(got, dict):
        return Verdict(False, "unreadable probe record")
    return Verdict(bool(got.get("ok")), str(got.get("detail", "")))


def require_usable(path: Path, costs, reference: Optional[Callable[[list[int], int], list[int]]] = None,
                   spawn: Callable[[Path], ChildRun] = spawn_child) -> None:
    """Raise LlamaCppUnusable (one line: what happened, how to rebuild) unless the probe passed."""
    verdict = probe(path, costs, reference, spawn)
    if not verdict.ok:
        raise LlamaCppUnusable(f"llama.cpp is unusable on this machine (build {build_identity()}, {Path(path).name}): "
                               f"{verdict.detail}; {REBUILD}")


def torch_reference(lm) -> Callable[[list[int], int], list[int]]:
    """reference() for `probe`: greedy tokens of a torch model (specdec's model interface)."""

    def greedy(prompt: list[int], n: int) -> list[int]:
        from specdec.decode import plain_generate
        from specdec.types import StopConditions

        return list(plain_generate(lm, [prompt], stop=StopConditions(max_new_tokens=n))[0].token_ids)

    return greedy


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m specdec.backends.llamacpp.probe FILE.gguf", file=sys.stderr)
        return 2
    try:
        out = run_in_child(Path(args[0]))
    except ModelLoadError as exc:
        print(str(exc), file=sys.stderr)
        return 3
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
