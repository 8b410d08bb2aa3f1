"""A draft or target service whose model sleeps in every call: the benchmark's stand-in for a
slower draft, a busy GPU or a network hop (sleeping uses no CPU), to measure what pipelining
hides. The services themselves know nothing of it.

    python -m specdec.bench.slow_service {draft,target} --delay-ms MS [the service's own flags]

The target makes one model call per verification step (plus one per session it rebuilds); the
draft one per drafted token.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Optional, Sequence



class SlowLM:
    """A model (specdec.backends.hf.CausalLM or any backend) whose forward and prefill first sleep `delay_s`;
    everything else is the wrapped model's."""

    def __init__(self, lm, delay_s: float):
        self._lm = lm
        self._delay_s = delay_s

    def __getattr__(self, name: str):
        return getattr(self._lm, name)

    def forward(self, *args, **kwargs):
        time.sleep(self._delay_s)
        return self._lm.forward(*args, **kwargs)

    def prefill(self, *args, **kwargs):
        time.sleep(self._delay_s)
        return self._lm.prefill(*args, **kwargs)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from specdec.rpc.serving import parse_settings, run_service

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("draft", "target"):
        print("usage: slow_service.py {draft,target} --delay-ms MS [service flags]", file=sys.stderr)
        return 2
    role, rest = argv[0], argv[1:]
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--delay-ms", type=float, required=True)
    known, rest = pre.parse_known_args(rest)
    delay_s = known.delay_ms / 1000
    if role == "target":
        import target_service.__main__ as svc

        async def serve(args):
            loaded = svc.load_target(args)
            await svc.serve_target(SlowLM(loaded.lm, delay_s), loaded.path, args)
    else:
        import draft_service.__main__ as svc

        async def serve(args):
            await svc.serve_draft(SlowLM(svc.load_draft_model(args), delay_s), args)
    return run_service(f"slow {role} service", serve, parse_settings(svc.build_parser(), rest))


if __name__ == "__main__":
    sys.exit(main())
