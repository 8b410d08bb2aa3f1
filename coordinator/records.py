"""A session as the coordinator keeps it in Redis (coordinator/sessions.py stores it), without
Redis: what the coordinator's core builds and reads."""

from __future__ import annotations

from dataclasses import dataclass, field

STORE_DOWN = "the session store is unreachable: try again shortly"  # what a client is told, never the exception


@dataclass
class SessionRecord:
    session_id: str
    prompt_len: int
    tokens: list[int]  # prompt + generated
    params: dict  # sampling, max_tokens, stop, eos, method, k
    status: str = "running"
    finish_reason: str = ""
    version: int = 0
    stats: dict = field(default_factory=dict)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]
