"""The draft service: a small model proposing tokens for many sessions."""
