"""Micro-batching: requests that arrive within a short window run as one batch on one worker
thread (the model's), so concurrent sessions share forward passes and the event loop never
blocks on torch.

Sessions cycle through two services (draft, then target), so they tend to split into cohorts
that reach each service at different times, each cohort a small batch. When more sessions are
active than are queued, the first request of a batch therefore waits a little for the rest:
up to `window_s`, stretched to `merge_fraction` of the last batch's run time (a straggler that
arrives within that much is cheaper to take along than to serve in a batch of its own).

Measured against continuous batching (a batch starts as soon as the model thread is free and
takes whatever queued meanwhile; window 0, no stretch), SmolLM2-135M on a shared 2-core CPU,
`specdec/bench/services.py --prompts 3 --max-new-tokens 32 --concurrency 8 --rounds 3 --threads 1
--profile`: 8 sessions gave 1.46x one session with continuous batching against 1.73-1.75x with
this wait. Continuous batching ran the target on ~3 sessions per forward instead of ~5.5 and
the draft on ~2 instead of ~5, and on a CPU a forward over more sessions costs much less per
session (target model time per session step 51 ms vs 34-37 ms); the model thread that waits
does not waste the CPU, which the draft (or the other cohort) uses meanwhile. Where a batched
forward costs about one forward and draft and target have their own devices, re-measure.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from dataclasses import dataclass
from typing import Any, Callable, Generic, Optional, Sequence, TypeVar

from specdec.errors import Overloaded
from specdec.service.metrics import ServiceMetrics

T = TypeVar("T")


@dataclass
class _Item(Generic[T]):
    payload: T
    future: asyncio.Future


class MicroBatcher(Generic[T]):
    """run_batch(payloads) runs on the executor and returns one result or Exception per payload."""

    def __init__(self, run_batch: Callable[[Sequence[T]], Sequence[Any]], max_batch: int = 8,
                 window_s: float = 0.002, max_queue: int = 256, metrics: Optional[ServiceMetrics] = None,
                 executor: Optional[concurrent.futures.Executor] = None,
                 expect_company: Optional[Callable[[], int]] = None, merge_fraction: float = 0.3):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.run_batch = run_batch
        self.max_batch = max_batch
        self.window_s = window_s
        self.max_queue = max_queue
        self.metrics = metrics
        self.executor = executor or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model")
        # How many requests a batch can expect (e.g. the sessions active lately); None: always wait window_s.
        self.expect_company = expect_company
        self.merge_fraction = merge_fraction
        self._last_run_s = 0.0
        self._queue: asyncio.Queue[_Item[T]] = asyncio.Queue()
        self._worker: Optional[asyncio.Task] = None
        self._alone_waiting = 0  # run_alone calls not started yet (counted from two threads)
        self._alone_lock = threading.Lock()

    def _ensure_worker(self) -> None:
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._run())

    async def submit(self, payload: T) -> Any:
        if self._queue.qsize() >= self.max_queue:
            raise Overloaded(f"server busy: {self._queue.qsize()} requests queued")
        self._ensure_worker()
        item = _Item(payload, asyncio.get_running_loop().create_future())
        self._queue.put_nowait(item)
        self._gauge()
        return await item.future  # cancelling the caller cancels the future: the item is skipped if not started

    async def run_alone(self, fn: Callable[[], Any]) -> Any:
        """Run one function on the model thread (e.g. a prefill), in turn with the batches."""
        waiting = [True]  # counted in _alone_waiting until it starts (or is cancelled unstarted)

        def stop_waiting() -> None:
            with self._alone_lock:
                if waiting[0]:
                    waiting[0] = False
                    self._alone_waiting -= 1

        def run() -> Any:
            stop_waiting()
            return fn()

        with self._alone_lock:
            self._alone_waiting += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, run)
        finally:
            stop_waiting()

    def others_waiting(self) -> bool:
        """Whether work waits for the model thread (requests queued, functions to run alone). Read
        from the model thread by a batch that could go on (a Decode's next tokens): it goes on
        only while this is false, so it never keeps another session waiting."""
        return self._alone_waiting > 0 or not self._queue.empty()

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(self._queue.qsize())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            expected = self.max_batch if self.expect_company is None else min(self.max_batch, self.expect_company())
            wait = 0.0 if expected <= 1 else max(self.window_s, self.merge_fraction * self._last_run_s)
            end = loop.time() + wait
            while len(batch) < self.max_batch:
                if len(batch) >= expected and self._queue.empty():
                    break
                if not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                    continue
                left = end - loop.time()
                if left <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), left))
                except asyncio.TimeoutError:
                    break
            self._gauge()
            batch = [it for it in batch if not it.future.done()]
            if not batch:
                continue
            if self.metrics is not None:
                self.metrics.batch_size.observe(len(batch))
            t0 = loop.time()
            try:
                results = await loop.run_in_executor(self.executor, self.run_batch, [it.payload for it in batch])
            except Exception as exc:  # noqa: BLE001 - a failed batch fails each of its callers
                results = [exc] * len(batch)
            self._last_run_s = loop.time() - t0
            if self.metrics is not None:
                self.metrics.model_busy.inc(self._last_run_s)
            for it, res in zip(batch, results):
                if it.future.done():
                    continue
                if isinstance(res, BaseException):
                    it.future.set_exception(res)
                else:
                    it.future.set_result(res)
            # Hold nothing of this batch while waiting for the next: a payload keeps its session
            # alive (on llama.cpp, a context that a released session would hand to the next one).
            del batch, results, it, res

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
        self.executor.shutdown(wait=False, cancel_futures=True)
