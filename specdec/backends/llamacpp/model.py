"""A GGUF model run by llama.cpp (through `llama-cpp-python`'s low-level API) behind the engine's
model interface: `new_cache`, `prefill`, `forward(cache, ids, block_mask, depth, input_valid,
logits_at, want_hidden)`, the same shapes as specdec.backends.hf.CausalLM.

- The model's weights are loaded once; each cache is a llama.cpp context whose rows are
  sequence ids with a KV stream each (`kv_unified = false`): no row's entries sit among
  another's. A dropped cache's context is cleared and reused by the next cache (`_Contexts`).
  Each row's block is its own `llama_decode` (see the limitations).
- A block is fed with explicit positions (the row's length + depth); logits only where asked,
  and with them the final hidden state when asked (context `embeddings`; Medusa heads read it).
- Rollback (`keep_last`, `truncate`) is `llama_memory_seq_rm` of the row's tail.

Limitations, measured on this llama.cpp (llama-cpp-python 0.3.36): blocks are chains only. Tree
blocks need several sequence ids over one KV buffer (`kv_unified`), and there a later input
placed in a cell freed by a rejected branch, or by another row's rollback, got wrong logits
(differences of 0.2-1.2 against the same tokens decoded in order; exact with separate streams),
so Lookahead stays on the torch backends and Medusa runs here as a chain of its heads' top
candidates. Rows of unequal lengths decoded in one `llama_decode` (several sequence ids, one KV
stream each) also changed some rows' logits by up to 1.0 once a row held more than 32 inputs,
so rows are decoded one after the other: batching across rows saves no weight reads on this
backend yet. The weights are the GGUF's own (quantized): outputs equal this backend's plain
decoding, not transformers'.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import hashlib
import os
import threading
import weakref
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable, Optional, Sequence, TypeVar

import numpy as np
import torch

from specdec.errors import InvalidRequest, ModelLoadError
from specdec.backends.hf import ForwardOutput
from specdec.backends.llamacpp.blocks import NotATree, block_parents, kept_path_end
from specdec.backends.llamacpp.build import build_identity


# A token's logits must not depend on how many tokens its forward holds: a k-token verify has to
# round as the 1-token steps of plain decoding do, or greedy speculative output parts from plain
# decoding at a near-tie (measured: a rag prompt of the dev set parted at its 36th token). This
# llama.cpp's CPU kernels are chosen by width in four places, each turned off here:
# - flash attention splits the KV of a 1-query forward over the threads from 512 cells up and tiles
#   from 64 queries (0.25 in the final hidden state, 0.65 in the logits at 2 tokens against 1):
#   contexts are made without it (the KV then holds V transposed; the logits are the same at every
#   width). Measured cost here: none on a decoding step, ~10-20% on a 700-token prefill.
# - llamafile's tinyBLAS takes matmuls from 2 tokens up: the build leaves it out
#   (scripts/llama-cmake-args.sh; with it and no flash attention, 0.07 and 0.22).
# - repacked weights (Q4_0, Q4_K, IQ4_NL on AVX2) have a 1-token gemv and a several-token gemm:
#   models are loaded without extra buffer types (use_extra_bufts).
# - K-quant matmuls are tiled from 8 tokens up (ggml-cpu/tiled): GGML_CPU_TILED_MM=0, which
#   llama.cpp reads once, before the first matmul.
# tests/integration/test_llamacpp_real.py checks the logits of every width against 1-token steps.
WIDTH_INVARIANT_ENV = {"GGML_CPU_TILED_MM": "0"}


def _lib():
    os.environ.update(WIDTH_INVARIANT_ENV)
    try:
        import llama_cpp
    except ImportError as exc:  # a clear error instead of a traceback deep in the engine
        raise ModelLoadError(f"the llama.cpp backend needs llama-cpp-python ({exc}): "
                             "run scripts/bootstrap.sh, or use backend='fast' or 'hf'") from None
    return llama_cpp


T = TypeVar("T")
_LOG_LOCK = threading.Lock()
_LOG_SINK = None  # the ctypes callback must outlive every call into llama.cpp
_ERRORS: list[str] = []


def _quiet_logs(lib) -> None:
    """llama.cpp logs every tensor it loads to stderr: keep only its errors, for our messages."""
    global _LOG_SINK
    with _LOG_LOCK:
        if _LOG_SINK is not None:
            return

        def sink(level, text, _user):
            if level >= 4:  # GGML_LOG_LEVEL_ERROR
                _ERRORS.append(text.decode(errors="replace").strip())
                del _ERRORS[:-20]

        _LOG_SINK = lib.llama_log_callback(sink)
        lib.llama_log_set(_LOG_SINK, ctypes.c_void_p())
        lib.llama_backend_init()


def _why() -> str:
    return "; ".join(_ERRORS[-2:]) or "no detail"


@dataclass(frozen=True)
class _Input:
    row: int  # the cache row (its sequence id: LlamaCppCache.seqs[row])
    column: int
    token: int
    pos: int
    logits: bool


class _Contexts:
    """llama.cpp contexts of one model, by sequence count, and the idle ones kept for reuse:
    making a context costs ~40 ms here (its KV buffer, its compute graph), as much as a short
    request's prefill, so a finished generation's or a released session's context is cleared
    (llama_memory_clear) and handed to the next cache of the same size; at most `keep` wait while
    other contexts are in use (more sessions are likely to come), and one once none is: each
    holds its whole KV buffer (~110 MB for the embedded model's 4096 tokens), so after a burst of
    sessions memory goes back to what one idle session costs.
    Clearing drops the cells' metadata only: no later forward attends to a cell marked empty (the
    masks are built from the cells) and new tokens overwrite the buffers, while zeroing them
    as well cost ~30 ms for a 4096-token context here, on the path of every finished request."""

    def __init__(self, lm: "LlamaCppLM", keep: int = 4):
        self.lm, self.keep = lm, keep
        self._idle: list[tuple[int, object, object]] = []  # (sequences, context, batch)
        self.made = 0  # contexts made so far (the rest were reused)
        self.in_use = 0  # contexts taken and not given back
        self._lock = threading.Lock()

    @property
    def idle(self) -> int:
        return len(self._idle)

    def take(self, n_seq: int) -> tuple[object, object]:
        with self._lock:
            self.in_use += 1
            for i in reversed(range(len(self._idle))):  # the most recently used first
                n, ctx, batch = self._idle[i]
                if n == n_seq:
                    del self._idle[i]
                    return ctx, batch
        try:
            return self._make(n_seq)
        except BaseException:
            with self._lock:
                self.in_use -= 1
            raise

    def _make(self, n_seq: int) -> tuple[object, object]:
        lm, lib = self.lm, self.lm.lib
        params = lib.llama_context_default_params()
        params.n_seq_max = n_seq
        params.n_ctx = lm.max_positions * n_seq
        params.n_batch = params.n_ubatch = lm.n_batch
        params.kv_unified = False
        params.n_threads = params.n_threads_batch = lm.threads
        params.no_perf = True
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED  # width-invariant: see WIDTH_INVARIANT_ENV
        ctx = lib.llama_init_from_model(lm.model_handle, params)
        if not ctx:
            raise ModelLoadError(f"llama.cpp could not make a context for {lm.name}: {_why()}")
        self.made += 1
        return ctx, lib.llama_batch_init(lm.n_batch, 0, 1)

    def give(self, n_seq: int, ctx, batch) -> None:
        lib = self.lm.lib
        lib.llama_memory_clear(lib.llama_get_memory(ctx), False)
        with self._lock:
            self.in_use -= 1
            self._idle.append((n_seq, ctx, batch))
            limit = self.keep if self.in_use else 1
            surplus, self._idle = self._idle[:-limit], self._idle[-limit:]  # the oldest go
        for _, old_ctx, old_batch in surplus:
            self.free(old_ctx, old_batch)

    def free(self, ctx, batch) -> None:
        self.lm.lib.llama_batch_free(batch)
        self.lm.lib.llama_free(ctx)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for _, ctx, batch in idle:
            self.free(ctx, batch)


@dataclass
class _ContextState:
    """What a context was last set to (threads, hidden states on), shared by its caches."""
    threads: int
    embeddings: bool = False


class _SharedContext:
    """One context of `slots` sequences (a KV stream each) whose sequence ids are handed to
    batch-1 caches of concurrent sessions, so that their plain steps go into one llama_decode
    (LlamaCppLM.join_caches). Made when a second session needs one (~0.5 s for 8 sequences of
    4096 tokens here: the KV buffers are cleared), freed by a reaper thread `idle_free_s` after
    its last sequence is given back (its buffers are most of a target service's memory). Calls
    into the context hold `lock`; a released sequence's cells are removed by the next take."""

    def __init__(self, lm: "LlamaCppLM", slots: int, idle_free_s: float = 3.0):
        self._lm = weakref.ref(lm)  # (the reaper thread must not keep the model alive)
        self.slots, self.idle_free_s = slots, idle_free_s
        self.lock = threading.RLock()
        self._wake = threading.Condition(self.lock)
        self.ctx = self.batch = self.mem = None
        self.state = _ContextState(lm.threads)
        self.free_seqs: list[int] = []
        self.dirty: list[int] = []  # given back, their cells not yet removed
        self.in_use = 0
        self.made = 0
        self._closed = False
        self._reaper: Optional[threading.Thread] = None

    def take(self) -> Optional[int]:
        """A free sequence id (the context made first if need be), or None when all are taken."""
        with self.lock:
            lm = self._lm()
            if lm is None or self._closed:
                return None
            if self.ctx is None:
                self.ctx, self.batch = lm.contexts._make(self.slots)
                self.mem = lm.lib.llama_get_memory(self.ctx)
                self.state = _ContextState(lm.threads)
                self.free_seqs, self.dirty, self.made = list(range(self.slots)), [], self.made + 1
                if self._reaper is None:
                    self._reaper = threading.Thread(target=self._reap, name="llamacpp-shared-reaper", daemon=True)
                    self._reaper.start()
            for seq in self.dirty:
                lm.lib.llama_memory_seq_rm(self.mem, seq, -1, -1)
            self.free_seqs += self.dirty
            self.dirty = []
            if not self.free_seqs:
                return None
            self.in_use += 1
            self._wake.notify_all()
            return self.free_seqs.pop(0)

    def give(self, seq: int) -> None:
        with self.lock:
            self.dirty.append(seq)
            self.in_use -= 1
            self._wake.notify_all()

    def _reap(self) -> None:
        """Free the context once it has had no sequence in use for idle_free_s."""
        with self.lock:
            while not self._closed:
                if self.ctx is None or self.in_use:
                    self._wake.wait()
                elif not self._wake.wait(self.idle_free_s) and self.ctx is not None and not self.in_use:
                    self._free()

    def _free(self, lm: Optional["LlamaCppLM"] = None) -> None:
        lm = lm or self._lm()
        if lm is not None and self.ctx is not None:
            lm.contexts.free(self.ctx, self.batch)
        self.ctx = self.batch = self.mem = None

    def close(self, lm: Optional["LlamaCppLM"] = None) -> None:
        """Free the context (lm: the model, from its own __del__, where its weak reference is gone)."""
        with self.lock:
            self._closed = True
            self._free(lm)
            self._wake.notify_all()


class LlamaCppCache:
    """One llama.cpp context; row b is sequence id b with a KV stream of its own. Or (`slot`) a
    batch-1 cache on one sequence of the model's shared context (share_context)."""

    def __init__(self, lm: "LlamaCppLM", batch_size: int, slot: Optional[tuple[_SharedContext, int]] = None):
        self.lib = lm.lib
        self.contexts = lm.contexts
        self.n_seq = max(batch_size, 1)
        self.shared, self.guard = None, contextlib.nullcontext()
        if slot is not None:
            self.shared, seq = slot
            self.guard = self.shared.lock
            self.ctx, self.batch, self.mem, self.state = (self.shared.ctx, self.shared.batch, self.shared.mem,
                                                          self.shared.state)
            self.seqs = [seq]
            self.n_stream = self.shared.slots
        else:
            self.ctx, self.batch = self.contexts.take(self.n_seq)
            self.state = _ContextState(lm.threads)
            self.mem = self.lib.llama_get_memory(self.ctx)
            self.seqs = list(range(batch_size))  # row -> its sequence id
            self.n_stream = self.n_seq  # KV streams of the context (one a sequence: kv_unified off)
        with self.guard:
            self.lib.llama_set_n_threads(self.ctx, lm.threads, lm.threads)  # a reused context may have had fewer
            self.state.threads = lm.threads
            self.lib.llama_set_embeddings(self.ctx, self.state.embeddings)  # (a reused context may have had them on)
        self.length = [0] * batch_size  # tokens kept per row (= the next input's position)
        # Per row, the columns of the last forward that were fed, until keep_last resolves them.
        self.pending: list[list[int]] = [[] for _ in range(batch_size)]
        self.members: Optional[list[LlamaCppCache]] = None  # a joined view's caches (join_caches)

    def __del__(self):
        if getattr(self, "ctx", None) and getattr(self, "members", None) is None:
            if self.shared is not None:
                self.shared.give(self.seqs[0])
            else:
                self.contexts.give(self.n_seq, self.ctx, self.batch)
            self.ctx = None

    @classmethod
    def joined(cls, members: Sequence["LlamaCppCache"]) -> "LlamaCppCache":
        """A view whose row j is members[j]'s sequence (batch-1 caches on one shared context);
        it owns nothing (dropping it gives nothing back)."""
        shared = members[0].shared
        view = cls.__new__(cls)
        view.lib, view.contexts, view.n_seq = members[0].lib, members[0].contexts, len(members)
        view.shared, view.guard = shared, shared.lock
        view.ctx, view.batch, view.mem, view.state = shared.ctx, shared.batch, shared.mem, shared.state
        view.seqs, view.n_stream = [c.seqs[0] for c in members], shared.slots
        view.length = [c.length[0] for c in members]
        view.pending = [[] for _ in members]
        view.members = list(members)
        return view

    def split(self) -> None:
        """A joined view's rows back to the caches it joined (after a step on it)."""
        self.settle()
        for member, n in zip(self.members, self.length):
            member.length[0], member.pending[0] = n, []

    @property
    def batch_size(self) -> int:
        return len(self.seqs)

    @property
    def lengths(self) -> torch.Tensor:
        """[batch] tokens per row, the last forward's inputs included (they stay unless keep_last drops them)."""
        return torch.tensor([n + len(p) for n, p in zip(self.length, self.pending)], dtype=torch.long)

    def settle(self) -> None:
        """Inputs not resolved by keep_last stay, as in every backend (plain decoding never calls it)."""
        self.length = [n + len(p) for n, p in zip(self.length, self.pending)]
        self.pending = [[] for _ in self.seqs]

    def set_threads(self, n: int) -> None:
        """llama.cpp threads for this cache's next forwards."""
        with self.guard:
            if n != self.state.threads:
                self.lib.llama_set_n_threads(self.ctx, n, n)
                self.state.threads = n

    def keep_last(self, keep: torch.Tensor) -> None:
        """Keep, per row, the first inputs of the last forward marked in keep [batch, q] (a chain:
        kept inputs are a prefix); drop the rest."""
        for b, fed in enumerate(self.pending):
            if not fed:
                continue
            flags = keep[b].tolist()
            self.length[b] += kept_path_end(list(range(-1, len(fed) - 1)), [flags[i] for i in fed]) + 1
            with self.guard:
                self.lib.llama_memory_seq_rm(self.mem, self.seqs[b], self.length[b], -1)
            self.pending[b] = []

    def truncate(self, lengths: torch.Tensor) -> None:
        """Roll each row back to its first lengths[b] tokens."""
        self.settle()
        for b, n in enumerate(lengths.tolist()):
            if n < self.length[b]:
                with self.guard:
                    self.lib.llama_memory_seq_rm(self.mem, self.seqs[b], int(n), -1)
                self.length[b] = int(n)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these rows (e.g. drop finished sequences); rows [batch'] long."""
        chosen = [int(r) for r in rows.tolist()]
        for b, seq in enumerate(self.seqs):
            if b not in chosen:
                with self.guard:
                    self.lib.llama_memory_seq_rm(self.mem, seq, -1, -1)
        self.seqs = [self.seqs[b] for b in chosen]
        self.length = [self.length[b] for b in chosen]
        self.pending = [self.pending[b] for b in chosen]

    def fill(self, items: Sequence[_Input]) -> None:
        """Put these inputs in the llama_batch (each in its row's sequence)."""
        batch = self.batch
        for j, item in enumerate(items):
            batch.token[j] = item.token
            batch.pos[j] = item.pos
            batch.n_seq_id[j] = 1
            batch.seq_id[j][0] = self.seqs[item.row]
            batch.logits[j] = int(item.logits)
        batch.n_tokens = len(items)

    def run_batch(self, want_hidden: bool) -> None:
        """llama_decode of the batch as filled (fill), with or without hidden states."""
        if want_hidden != self.state.embeddings:
            # The final hidden state (after the output norm) beside the logits (Medusa heads read it):
            # switched on only while asked, since it makes a long prompt's prefill ~10% slower.
            self.lib.llama_set_embeddings(self.ctx, want_hidden)
            self.state.embeddings = want_hidden
        rc = self.lib.llama_decode(self.ctx, self.batch)
        if rc != 0:
            why = "a row outgrew its context" if rc == 1 else f"llama_decode returned {rc}"
            raise InvalidRequest(f"llama.cpp: {why} ({_why()})")

    def decode(self, items: list[_Input], vocab_size: int,
               hidden_size: int = 0) -> dict[tuple[int, int], tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """One llama_decode of these inputs -> (logits [vocab], with hidden_size the final hidden
        state [hidden] too) of those that asked, by (row, column)."""
        lib = self.lib
        asked = {j: (item.row, item.column) for j, item in enumerate(items) if item.logits}
        with self.guard:
            self.fill(items)
            self.run_batch(hidden_size > 0)
            return {key: (_floats(lib.llama_get_logits_ith(self.ctx, j), vocab_size),
                          _floats(lib.llama_get_embeddings_ith(self.ctx, j), hidden_size) if hidden_size else None)
                    for j, key in asked.items()}


class LlamaCppLM:
    """A GGUF causal LM on llama.cpp. threads: llama.cpp's threads (default: torch's count, so
    `--threads` means the same on every backend); context: tokens per row of a cache (default:
    the model's training context, at most 4096: each row's KV stream is allocated whole)."""

    # what it declares (specdec.backends.base.ModelBackend)
    backend = "llamacpp"
    head_rows = None
    returns_hidden = True  # forward(want_hidden=True): the final hidden state where logits are asked
    returns_taps = False  # no inner layers: llama.cpp returns the final hidden state only
    runs_trees = False  # causal chains only: see the module docstring
    stacks_caches = False  # a cache is a llama.cpp context: sessions run side by side instead (run_each)
    greedy_steps = True  # greedy_step: the argmax read straight from llama.cpp's logits buffer, no copy

    def __init__(self, path: str | Path, name: Optional[str] = None, threads: Optional[int] = None,
                 context: Optional[int] = None, n_batch: int = 512):
        lib = self.lib = _lib()
        _quiet_logs(lib)
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"GGUF file not found: {self.path}")
        self.name = name or self.path.stem
        params = lib.llama_model_default_params()
        params.use_extra_bufts = False  # no repacked weights: see WIDTH_INVARIANT_ENV
        self.model_handle = lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not self.model_handle:
            raise ModelLoadError(f"llama.cpp could not load {self.path}: {_why()}")
        vocab = lib.llama_model_get_vocab(self.model_handle)
        self.vocab_size = int(lib.llama_vocab_n_tokens(vocab))
        self.hidden_size = int(lib.llama_model_n_embd(self.model_handle))
        self.max_positions = int(context or min(lib.llama_model_n_ctx_train(self.model_handle), 4096))
        self.threads = int(threads or torch.get_num_threads())
        self.n_batch = n_batch  # tokens a llama_decode (and a ubatch) holds: llama-server's ubatch by default
        eos = {int(lib.llama_vocab_eos(vocab)), int(lib.llama_vocab_eot(vocab))}
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(t for t in eos if t >= 0))
        self._tables: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._file_identity: Optional[dict] = None
        self.contexts = _Contexts(self)
        self.shared: list[_SharedContext] = []  # share_context
        self.joined_decodes = 0  # llama_decode calls that fed several sessions' steps (join_caches)
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None  # run_each's workers
        self._pool_lock = threading.Lock()

    # A restored prefix of any length gives a fresh prefill's logits, bit for bit: every width rounds
    # alike (WIDTH_INVARIANT_ENV). With flash attention on, its CPU kernels were tiled from 64 queries
    # up and only whole 512-token blocks could be reused (logits moved by up to 0.8 otherwise).
    prefill_block = 1

    def __del__(self):
        lib = getattr(self, "lib", None)
        if lib is not None and getattr(self, "model_handle", None):
            for shared in getattr(self, "shared", None) or []:
                shared.close(self)
            if getattr(self, "contexts", None) is not None:
                self.contexts.close()  # (a cache still alive holds the LM through its pool: none is)
            lib.llama_model_free(self.model_handle)
            self.model_handle = None

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32  # of the logits it returns

    def output_bias(self) -> None:
        return None  # the GGUF architectures served here have no output bias

    def embedding_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input embeddings, output layer) [vocab, hidden], dequantized from the GGUF to float32
        once (a torch draft built on this target shares them, specdec.drafts)."""
        if self._tables is None:
            import gguf

            reader = gguf.GGUFReader(str(self.path))
            found = {t.name: t for t in reader.tensors if t.name in ("token_embd.weight", "output.weight")}
            tables = {name: torch.from_numpy(np.array(
                gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(self.vocab_size, -1))
                for name, t in found.items()}
            inputs = tables["token_embd.weight"]
            self._tables = (inputs, tables.get("output.weight", inputs))  # no output.weight: tied
        return self._tables

    def cost_identity(self) -> dict:
        if self._file_identity is None:  # (the loaded file's: read once, not on every request's method choice)
            self._file_identity = gguf_identity(self.path)
        return {"impl": type(self).__qualname__, "name": self.name, **self._file_identity, "threads": self.threads}

    def new_cache(self, batch_size: int) -> LlamaCppCache:
        """A cache of batch_size rows on a context of its own; with share_context, a batch-1 cache
        made while another is in use gets a sequence of a shared context instead (the one with the
        fewest in use, while one is free), so concurrent sessions' steps can be joined. A lone
        session keeps a context of its own: its outputs never depend on other sessions' and no
        shared context is made for it."""
        if batch_size == 1 and self.shared and (self.contexts.in_use or any(sh.in_use for sh in self.shared)):
            for shared in sorted(self.shared, key=lambda sh: sh.in_use):
                seq = shared.take()
                if seq is not None:
                    return LlamaCppCache(self, 1, slot=(shared, seq))
        return LlamaCppCache(self, batch_size)

    def share_context(self, slots: int, idle_free_s: float = 3.0) -> None:
        """Let up to `slots` concurrent batch-1 caches share contexts (new_cache; slots < 2: none):
        one per thread (at most slots // 2), each decoded on one thread, their groups side by side
        (run_each), every group's plain steps one llama_decode (join_caches). Measured here
        (2 threads, 8 sessions of ~150-220 tokens, ms a token): 6.7 for 2 contexts x 4 sessions
        on a thread each, 8.3 for the 8 side by side on contexts of their own, 5.4 for one
        context of 8 on both threads; with another process busy on a core, 11.2, 13.2 and
        18.8-24.8: llama.cpp's threads wait for each other at every operation, so a forward on two
        threads stalls whenever either is preempted, and one thread a context keeps the gain.
        Logits then differ from a session's step alone by llama.cpp's batch-size rounding (up to
        ~0.7 here, as a prefill split in two pieces: ~0.4), so greedy outputs agree with plain
        decoding up to near-ties. The target service's --join-sessions."""
        if any(sh.in_use for sh in self.shared):
            raise ValueError("caches still hold sequences of a shared context")
        for shared in self.shared:
            shared.close(self)
        n = max(1, min(self.threads, slots // 2))
        self.shared = [_SharedContext(self, -(-slots // n), idle_free_s) for _ in range(n)] if slots > 1 else []

    def join_caches(self, caches: Sequence[LlamaCppCache]) -> list[tuple[LlamaCppCache, list[int]]]:
        """[(view, idx)]: per shared context, one multi-row view of those of the caches that are
        settled batch-1 caches on it (row j: caches[idx[j]]'s sequence), whose forwards feed every
        row's one-token step in one llama_decode; groups of fewer than two are left out. After a
        step on a view, view.split() hands each cache its row's length back."""
        groups = []
        for shared in self.shared:
            idx = [i for i, c in enumerate(caches) if c.shared is shared and c.ctx is shared.ctx
                   and c.members is None and c.batch_size == 1 and not c.pending[0]]
            # Each row of a joined forward attends over as many cells as its longest row holds:
            # join only rows within JOIN_SPAN tokens of the shortest (the longer ones run alone).
            if idx:
                shortest = min(caches[i].length[0] for i in idx)
                idx = [i for i in idx if caches[i].length[0] <= shortest + JOIN_SPAN]
            if len(idx) < 2:
                continue
            groups.append((LlamaCppCache.joined([caches[i] for i in idx]), idx))
        return groups

    def snapshot_prefix(self, cache: LlamaCppCache, n: int) -> tuple[object, int]:
        """(row 0's llama.cpp sequence state holding its first n tokens, its bytes): the state of
        the whole row is copied out (llama_state_seq_get_data) and restore_prefix drops what lies
        past n, so the cached KV is the very KV this context computed. Kept without its streams'
        layout (seq_state_payload), so a context of one sequence and the shared one of several
        restore each other's snapshots."""
        cache.settle()
        if n < 1 or n > cache.length[0]:
            raise ValueError(f"cannot snapshot {n} tokens of a row holding {cache.length[0]}")
        lib, seq = self.lib, cache.seqs[0]
        with cache.guard:
            size = lib.llama_state_seq_get_size(cache.ctx, seq)
            data = bytearray(size)  # written in place by llama.cpp: one copy of the KV, none in Python
            if lib.llama_state_seq_get_data(cache.ctx, (ctypes.c_uint8 * size).from_buffer(data), size, seq) != size:
                raise ModelLoadError(f"llama.cpp could not copy a sequence's state ({_why()})")
        payload = seq_state_payload(data, cache.n_stream, seq)
        return (payload, cache.length[0]), len(payload)

    def restore_prefix(self, cache: LlamaCppCache, snapshot: object, n: int) -> None:
        """Make an empty batch-1 cache hold the first n tokens of a snapshot_prefix snapshot."""
        payload, held = snapshot
        if cache.length[0] or any(cache.pending) or not 1 <= n <= held:
            raise ValueError("restore_prefix needs an empty batch-1 cache and n within the snapshot")
        data = seq_state_for(payload, cache.n_stream)  # (a private context's: the payload itself, not copied)
        with cache.guard:
            if self.lib.llama_state_seq_set_data(cache.ctx, (ctypes.c_uint8 * len(data)).from_buffer(data), len(data),
                                                 cache.seqs[0]) == 0:
                raise ModelLoadError(f"llama.cpp could not restore a sequence's state ({_why()})")
            if n < held:
                self.lib.llama_memory_seq_rm(cache.mem, cache.seqs[0], n, -1)
        cache.length[0] = n

    def run_each(self, jobs: Sequence[Callable[[], T]], caches: Sequence[LlamaCppCache]) -> list[T]:
        """Run jobs[i], a step on caches[i] alone (sessions of a service), spreading them over this
        model's threads: with t threads and n jobs, min(t, n) run at once, each context given t //
        that many threads (llama.cpp's decode releases the GIL), so one session keeps every thread
        and several use every core without splitting one forward finely. Results in order."""
        workers = min(self.threads, len(jobs))
        if len({id(c.ctx) for c in caches}) < len(caches):
            workers = 1  # two caches on one context (the shared one): its calls take turns anyway
        for cache in caches:
            cache.set_threads(self.threads // max(workers, 1))
        if workers <= 1:
            return [job() for job in jobs]
        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="llamacpp")
        return [f.result() for f in [self._pool.submit(job) for job in jobs]]

    @torch.inference_mode()
    def forward(self, cache: LlamaCppCache, input_ids: torch.Tensor, block_mask: Optional[torch.Tensor] = None,
                depth: Optional[torch.Tensor] = None, input_valid: Optional[torch.Tensor] = None,
                logits_at: Optional[torch.Tensor] = None, want_hidden: bool = False) -> ForwardOutput:
        """As CausalLM.forward: input_ids [batch, q]; block_mask [batch, q, q] (causal chains only
        here, see the module docstring); depth [batch, q]; input_valid [batch, q] (padding is not
        fed); logits_at [m]: the only columns whose logits are returned. want_hidden: also the
        final hidden state [batch, q, hidden] (after the output norm, as transformers' last
        hidden_states), filled at the columns whose logits are computed (zeros elsewhere)."""
        batch, q = input_ids.shape
        if batch != cache.batch_size:
            raise ValueError(f"input rows {batch} != cache rows {cache.batch_size}")
        cache.settle()
        if q == 1 and input_valid is None and logits_at is None and (depth is None or not depth.any()):
            return self._step(cache, input_ids, want_hidden)  # (a one-token block is a chain)
        cols = list(range(q)) if logits_at is None else [int(c) for c in logits_at.tolist()]
        want = set(cols)
        items: list[_Input] = []
        for b in range(batch):
            fed = [i for i in range(q) if input_valid is None or bool(input_valid[b, i])]
            _check_chain(block_mask, depth, b, fed)
            items += [_Input(b, i, int(input_ids[b, i]), cache.length[b] + n, i in want) for n, i in enumerate(fed)]
            cache.pending[b] = fed
        logits = torch.zeros(batch, len(cols), self.vocab_size)
        hidden = torch.zeros(batch, q, self.hidden_size) if want_hidden else None
        at = {c: j for j, c in enumerate(cols)}
        for b in range(batch):  # one row per llama_decode: see the module docstring
            row = [item for item in items if item.row == b]
            for start in range(0, len(row), self.n_batch):
                got = cache.decode(row[start : start + self.n_batch], self.vocab_size,
                                   self.hidden_size if want_hidden else 0)
                for (_, i), (values, state) in got.items():
                    logits[b, at[i]] = values
                    if hidden is not None:
                        hidden[b, i] = state
        return ForwardOutput(logits=logits, hidden=hidden)

    def _step(self, cache: LlamaCppCache, input_ids: torch.Tensor, want_hidden: bool) -> ForwardOutput:
        """forward for one token per row (a decoding step): the same llama_decode calls, without
        the bookkeeping of blocks."""
        tokens = input_ids[:, 0].tolist()
        items = [_Input(b, 0, token, cache.length[b], True) for b, token in enumerate(tokens)]
        for b in range(len(tokens)):
            cache.pending[b] = [0]
        hidden_size = self.hidden_size if want_hidden else 0
        if cache.members is not None:  # sessions joined on the shared context: one llama_decode
            got = cache.decode(items, self.vocab_size, hidden_size)
            self.joined_decodes += 1
            outs = [got[(b, 0)] for b in range(len(tokens))]
        else:  # rows of one cache: one after the other (see the module docstring)
            outs = [cache.decode([item], self.vocab_size, hidden_size)[(item.row, 0)] for item in items]
        logits, hidden = [v for v, _ in outs], [h for _, h in outs]
        if len(logits) == 1:  # (one session's step: views, no second copy of the logits)
            return ForwardOutput(logits=logits[0].view(1, 1, -1),
                                 hidden=hidden[0].view(1, 1, -1) if want_hidden else None)
        return ForwardOutput(logits=torch.stack(logits)[:, None],
                             hidden=torch.stack(hidden)[:, None] if want_hidden else None)

    def greedy_step(self, cache: LlamaCppCache, token: int) -> int:
        """Feed one token to a batch-1 cache and return its logits' argmax (the first of equal
        maxima, as torch's): a greedy decoding step without copying the logits out. Measured in
        the target service's Decode: ~1 ms of Python a token less than forward() + argmax, at
        ~11 ms a token in all."""
        if cache.batch_size != 1 or cache.pending[0]:
            raise ValueError("greedy_step needs a settled batch-1 cache")
        with cache.guard:
            cache.fill((_Input(0, 0, token, cache.length[0], True),))
            cache.run_batch(want_hidden=False)
            cache.length[0] += 1
            return int(np.ctypeslib.as_array(self.lib.llama_get_logits_ith(cache.ctx, 0),
                                             shape=(self.vocab_size,)).argmax())

    @torch.inference_mode()
    def prefill(self, cache: LlamaCppCache, prompts: Sequence[Sequence[int]],
                want_hidden: bool = False, all_hidden: bool = False) -> ForwardOutput:
        """Feed prompts of different lengths; logits [batch, vocab] (and hidden [batch, hidden]) at
        each row's last token. all_hidden: hidden [batch, width, hidden] at every fed position
        instead (as CausalLM.prefill; llama.cpp then computes every position's logits too)."""
        lens = torch.tensor([len(p) for p in prompts])
        width = int(lens.max())
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(list(p), dtype=torch.long)
        valid = torch.arange(width)[None, :] < lens[:, None]  # [batch, width]
        last = lens - 1
        rows = torch.arange(len(prompts))
        if all_hidden:  # llama.cpp returns hidden states only where it computes logits
            out = self.forward(cache, ids, input_valid=valid, want_hidden=True)
            cache.settle()
            return ForwardOutput(logits=out.logits[rows, last], hidden=out.hidden)
        cols, inverse = torch.unique(last, return_inverse=True)
        out = self.forward(cache, ids, input_valid=valid, logits_at=cols, want_hidden=want_hidden)
        cache.settle()
        return ForwardOutput(logits=out.logits[rows, inverse], hidden=out.hidden[rows, last] if want_hidden else None)


# Measured here (2 threads): joining 8 sessions' steps saves ~3 ms a token of weight reads,
# what attending over ~420 more cells costs (~0.007 ms a cell a token).
JOIN_SPAN = 384

_U32 = 4
_HEAD = 2 * _U32  # a sequence state's magic and the id of the sequence it was copied from


def seq_state_payload(data: bytearray, n_stream: int, stream: int) -> bytearray:
    """A sequence's state as llama_state_seq_get_data writes it on a context of n_stream KV
    streams (this llama.cpp: a u32 magic, the i32 sequence id, a u32 stream count, then per stream
    a u32 cell count and, where non-zero, those cells; only the sequence's own stream holds any)
    -> the same as a context of one stream writes it (data itself when n_stream is 1: a snapshot of
    a private context is never copied in Python; at ~23 KB of KV a token a long prompt's state
    is tens of MB)."""
    before, after = _HEAD + _U32 * (1 + stream), _U32 * (n_stream - 1 - stream)
    if (len(data) < before + after + _U32 or int.from_bytes(data[_HEAD:_HEAD + _U32], "little") != n_stream
            or any(data[_HEAD + _U32:before]) or (after and any(data[len(data) - after:]))):
        raise ModelLoadError(f"llama.cpp wrote a sequence state of an unexpected layout ({n_stream} streams expected)")
    if n_stream == 1:
        return data
    one = bytearray(data[:_HEAD])
    one += (1).to_bytes(_U32, "little")
    one += memoryview(data)[before:len(data) - after]
    return one


def seq_state_for(payload: bytearray, n_stream: int) -> bytearray:
    """seq_state_payload's one-stream state as a sequence state for a context of n_stream streams
    (the cells go to the stream of the sequence llama_state_seq_set_data is given); the payload
    itself for one stream."""
    if n_stream == 1:
        return payload
    streams = bytearray(payload[:_HEAD])
    streams += n_stream.to_bytes(_U32, "little")
    streams += memoryview(payload)[_HEAD + _U32:]
    streams += bytes(_U32 * (n_stream - 1))
    return streams


def _floats(pointer, n: int) -> torch.Tensor:
    """A copy of n floats llama.cpp returned (its buffers are reused by the next decode)."""
    return torch.from_numpy(np.ctypeslib.as_array(pointer, shape=(n,)).copy())


def gguf_identity(path: Path) -> dict:
    """What a cost measured on this GGUF file depends on, read without loading it: the file
    (size, a digest of its first MiB) and the llama.cpp build (its version, and a digest of its
    shared libraries: the same version compiled with other flags runs other kernels)."""
    with Path(path).open("rb") as f:
        head = hashlib.sha256(f.read(1 << 20)).hexdigest()[:16]
    try:
        version = metadata.version("llama_cpp_python")
    except metadata.PackageNotFoundError:
        version = "none"
    return {"file_bytes": Path(path).stat().st_size, "file_head": head, "llama_cpp": version,
            "llama_build": build_identity()}


def _check_chain(block_mask: Optional[torch.Tensor], depth: Optional[torch.Tensor], b: int, fed: list[int]) -> None:
    """Refuse a block that is not a causal chain (see the module docstring for why)."""
    if block_mask is not None:
        try:
            parents = block_parents(block_mask[b][fed][:, fed], len(fed))
        except NotATree as exc:
            raise InvalidRequest(f"the llama.cpp backend runs causal blocks only: {exc}") from None
        if parents != list(range(-1, len(fed) - 1)):
            raise InvalidRequest("the llama.cpp backend runs causal blocks only, not trees (Medusa, Lookahead): "
                                 "use backend fast or hf")
    if depth is not None and [int(depth[b, i]) for i in fed] != list(range(len(fed))):
        raise InvalidRequest("the llama.cpp backend runs causal blocks only: depths must be 0, 1, 2, ...")
