"""specdec: lossless speculative decoding as a library and a distributed service."""

__version__ = "0.1.0"
