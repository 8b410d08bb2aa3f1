"""Lean model implementations of our own that load the same weights as transformers' and plug
into the engine through the CausalLM interface (forward / prefill / new_cache).

They exist for speed on small CPUs (see specdec/fast/llama.py for what was measured and why);
any transformers causal LM keeps working through specdec.lm.CausalLM.
"""

from specdec.fast.llama import FastKVCache, FastLlamaLM, supports_fast

__all__ = ["FastKVCache", "FastLlamaLM", "supports_fast"]
