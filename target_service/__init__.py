"""The target (verifier) service: batched Verify, target-side Decode for fallback."""
