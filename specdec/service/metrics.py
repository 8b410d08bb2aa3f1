"""Prometheus metrics of one service process, on its own registry (so several services can
share a process in tests). Counters, not rates; names follow vLLM's spec-decode metrics where
they exist (`specdec_spec_decode_num_drafts_total`, `..._num_draft_tokens_total`,
`..._num_accepted_tokens_total`, `..._num_accepted_tokens_per_pos_total`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

PREFIX = "specdec"
MAX_POSITIONS = 16  # per-position accepted counts are kept for the first 16 draft positions


class ServiceMetrics:
    def __init__(self, service: str):
        self.service = service
        self.registry = r = CollectorRegistry()
        self.request_latency = Histogram(f"{PREFIX}_request_latency_seconds", "gRPC call latency",
                                         ["method", "code"], registry=r,
                                         buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
        self.queue_depth = Gauge(f"{PREFIX}_queue_depth", "requests waiting for the model", registry=r)
        self.batch_size = Histogram(f"{PREFIX}_batch_size", "sessions per model forward", registry=r,
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32))
        self.model_busy = Counter(f"{PREFIX}_model_busy_seconds", "time the model thread spent running batches",
                                  registry=r)
        self.sessions = Gauge(f"{PREFIX}_sessions", "sessions held (KV caches in memory, or live generations)",
                              registry=r)
        self.replicas_live = Gauge(f"{PREFIX}_replicas_live", "replicas of each service the coordinator calls "
                                   "that are in its ring (serving, not cooling down after a failure)", ["service"],
                                   registry=r)
        self.sessions_waiting = Gauge(f"{PREFIX}_sessions_waiting", "sessions waiting for a slot on a target "
                                      "(coordinator; vLLM's num_requests_waiting)", registry=r)
        self.session_rebuilds = Counter(f"{PREFIX}_session_rebuilds", "sessions rebuilt from their committed tokens",
                                        registry=r)
        self.num_drafts = Counter(f"{PREFIX}_spec_decode_num_drafts", "verified proposals", registry=r)
        self.num_draft_tokens = Counter(f"{PREFIX}_spec_decode_num_draft_tokens", "drafted tokens", registry=r)
        self.num_accepted_tokens = Counter(f"{PREFIX}_spec_decode_num_accepted_tokens", "accepted draft tokens",
                                           registry=r)
        self.num_accepted_per_pos = Counter(f"{PREFIX}_spec_decode_num_accepted_tokens_per_pos",
                                            "accepted draft tokens by position in the block", ["position"], registry=r)
        self.num_emitted_tokens = Counter(f"{PREFIX}_spec_decode_num_emitted_tokens",
                                          "emitted tokens (accepted + recovered or bonus)", registry=r)
        self.target_forwards = Counter(f"{PREFIX}_target_forwards", "target forward passes (verify steps)", registry=r)
        self.fallback_steps = Counter(f"{PREFIX}_fallback_steps", "target-side steps taken without the draft",
                                      registry=r)
        self.pipeline_hits = Counter(f"{PREFIX}_pipeline_hits", "pipelined blocks used", registry=r)
        self.pipeline_misses = Counter(f"{PREFIX}_pipeline_misses", "pipelined blocks discarded", registry=r)
        self.generated_tokens = Counter(f"{PREFIX}_generated_tokens", "tokens committed to sessions", registry=r)
        # The target's prefix cache (vLLM's names): tokens looked up, tokens found (prefill saved).
        self.prefix_cache_queries = Counter(f"{PREFIX}_prefix_cache_queries", "prompt tokens looked up in the "
                                            "prefix cache", registry=r)
        self.prefix_cache_hits = Counter(f"{PREFIX}_prefix_cache_hits", "prompt tokens found in the prefix cache",
                                         registry=r)
        self.prefix_cache_bytes = Gauge(f"{PREFIX}_prefix_cache_bytes", "bytes of KV the prefix cache holds",
                                        registry=r)
        self.prefix_cache_evictions = Counter(f"{PREFIX}_prefix_cache_evictions", "prefix cache entries evicted",
                                              registry=r)
        # The target's history drafts (specdec.token_history): its drafted and accepted tokens count above.
        self.history_tokens = Gauge(f"{PREFIX}_history_tokens", "tokens of finished sessions kept for history drafts",
                                    registry=r)
        # The coordinator's per-step timeline (propose, verify, decode, commit, notify, step, detokenize):
        # where a step's wall time goes, as specdec/bench/services.py --profile prints it.
        self.step_phase = Histogram(f"{PREFIX}_step_phase_seconds", "time per phase of a session step", ["phase"],
                                    registry=r, buckets=(.0005, .001, .0025, .005, .01, .025, .05, .1, .25, 1))

    def record_verdict(self, num_drafted: int, num_accepted: int, num_emitted: int) -> None:
        self.target_forwards.inc()
        self.num_emitted_tokens.inc(num_emitted)
        if num_drafted:
            self.num_drafts.inc()
            self.num_draft_tokens.inc(num_drafted)
            self.num_accepted_tokens.inc(num_accepted)
            for pos in range(min(num_accepted, MAX_POSITIONS)):
                self.num_accepted_per_pos.labels(position=str(pos)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def serve_http(self, host: str, port: int):
        """Serve /metrics on host:port (0: any free port) -> (http server, thread)."""
        return start_http_server(port, addr=host, registry=self.registry)
