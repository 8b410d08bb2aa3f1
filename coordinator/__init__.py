"""The coordinator: the public API. Tokenizes, keeps sessions in Redis, drives the draft and
target services (pipelined, session-affine), and falls back to target-side decoding."""
