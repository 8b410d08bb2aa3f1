"""Stop conditions applied to emitted tokens: EOS, stop strings, max_new_tokens.

Both decoding loops feed every emitted token through the same `StopChecker`, so a step that
emits several tokens stops at exactly the token where plain decoding would have stopped.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

from specdec.types import StopConditions

Detokenize = Callable[[Sequence[int]], str]


class StopChecker:
    """Collects one sequence's generated tokens and says when (and why) it is finished."""

    # Stop strings are searched in the text of the last few tokens only: any match must
    # involve the newest token, or it would have stopped the sequence a step earlier.
    _WINDOW_TOKENS = 16

    def __init__(self, stop: StopConditions, detokenize: Optional[Detokenize] = None):
        if stop.stop_strings and detokenize is None:
            raise ValueError("stop strings need a detokenizer")
        self.stop = stop
        self.detokenize = detokenize
        self.generated: list[int] = []
        self.finish_reason: Optional[str] = None
        self._window = self._WINDOW_TOKENS + max((len(s) for s in stop.stop_strings), default=0)

    @property
    def remaining(self) -> int:
        return self.stop.max_new_tokens - len(self.generated)

    def push(self, tokens: Iterable[int]) -> list[int]:
        """Append tokens up to the first stop; returns the tokens actually taken."""
        taken = []
        for tok in tokens:
            if self.finish_reason is not None:
                break
            self.generated.append(int(tok))
            taken.append(int(tok))
            if tok in self.stop.eos_token_ids or self._hit_stop_string():
                self.finish_reason = "stop"
            elif self.remaining <= 0:
                self.finish_reason = "length"
        return taken

    def _hit_stop_string(self) -> bool:
        if not self.stop.stop_strings:
            return False
        tail = self.detokenize(self.generated[-self._window :])
        return any(s in tail for s in self.stop.stop_strings)


def cut_at_stop_string(text: str, stop_strings: Sequence[str]) -> str:
    """The text before the earliest stop string (stop strings are not part of the answer)."""
    cut = min((i for i in (text.find(s) for s in stop_strings) if i >= 0), default=len(text))
    return text[:cut]
