"""The coordinator's settings: one frozen dataclass, built once at start-up (flags or TOML)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CoordinatorSettings:
    session_ttl_s: int = 3600
    default_max_tokens: int = 128
    default_k: int = 4  # drafted tokens a step until the cost model has measured the draft (draft_k), unless a client gives k
    max_k: int = 16
    pipeline: bool = False  # draft block i+1 while block i is verified (see specdec/bench/services.py)
    step_streams: bool = True  # Propose / Verify on one stream per session and replica (False: a unary call per step)
    commit_behind: bool = True  # write step i to Redis while step i+1 runs (streams still see only written tokens)
    fallback_chunk: int = 8  # tokens per target-side Decode while the draft is out (then drafting is retried)
    # Most tokens per Decode on the target alone (chunks grow 1, 2, 4, ... to it: the first token
    # streams at once); a round trip per chunk costs ~2 ms against ~10 ms a token on a CPU.
    decode_chunk: int = 16
    # ... and for a session no one streams (a unary request) without stop strings: it starts whole
    # and saves the round trips of the ramp (measured: ~4 ms each, 8 of them in a 64-token answer).
    unary_chunk: int = 64
    propose_deadline_s: float = 5.0  # a Propose slower than this opens the draft's breaker
    draft_cooldown_s: float = 1.0  # a failed draft replica stays out at least this long
    probe_interval_s: float = 0.5  # health checks of every replica
    target_wait_s: float = 30.0  # how long a session waits for a live target replica
    max_active: int = 256  # concurrent runs; more are refused (RESOURCE_EXHAUSTED)
    # Sessions generating at once per live target replica; the other runs wait their turn (coordinator.slots)
    sessions_per_target: int = 8
    release_wait_s: float = 5.0  # at shutdown: how long the finished sessions' Releases in flight may take to land
