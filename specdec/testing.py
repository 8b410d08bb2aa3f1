"""Tiny models for tests and the load benchmark: built in code, seeded, nothing downloaded."""

from __future__ import annotations

import copy

import torch

from specdec.backends.hf import CausalLM


def tiny_llama(seed: int = 0, vocab_size: int = 64, num_layers: int = 2, hidden_size: int = 32,
               max_positions: int = 512, eos_token_id: int = 1) -> CausalLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_positions, eos_token_id=eos_token_id, bos_token_id=0, pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger logits than the default init: sharper, more varied greedy paths
        model.lm_head.weight.mul_(8.0)
    return CausalLM(model.eval(), name=f"tiny-llama-{seed}")


def perturbed_copy(lm: CausalLM, noise: float, seed: int = 0) -> CausalLM:
    """A copy of `lm` with Gaussian noise on every weight: a test draft that agrees often, not always."""

    model = copy.deepcopy(lm.model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std().clamp_min(1e-6))
    return CausalLM(model.eval(), name=f"{lm.name}-noisy{noise}")
