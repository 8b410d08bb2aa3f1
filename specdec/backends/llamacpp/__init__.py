"""The llama.cpp backend: GGUF models run by llama.cpp behind the engine's model interface."""

from specdec.backends.llamacpp.model import LlamaCppLM

__all__ = ["LlamaCppLM"]
