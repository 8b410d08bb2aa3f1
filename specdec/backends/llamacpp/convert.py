"""Write a transformers Llama-family model as a GGUF file llama.cpp runs (float32 or float16
tensors; the `gguf` package, no llama.cpp tools): tests make tiny GGUF models this way, and a
torch draft can be moved onto llama.cpp.

The vocabulary is written as placeholder SentencePiece pieces: specdec tokenizes with the
transformers tokenizer and hands llama.cpp token ids only, so the pieces are never used.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def _rope_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """transformers' rotate-half layout of q/k rows -> GGUF's interleaved-pairs layout (what
    llama.cpp's converter does for Llama)."""
    return (weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_llama_gguf(model: torch.nn.Module, path: str | Path, dtype: str = "f32", name: str = "model") -> Path:
    """model: a transformers LlamaForCausalLM (or a config-compatible causal LM); dtype f32|f16."""
    import gguf

    if dtype not in ("f32", "f16"):
        raise ValueError(f"dtype must be f32 or f16, got {dtype!r}")
    np_dtype = np.float32 if dtype == "f32" else np.float16
    cfg = model.config
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head
    vocab = int(model.get_output_embeddings().weight.shape[0])
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_context_length(int(cfg.max_position_embeddings))
    writer.add_embedding_length(int(cfg.hidden_size))
    writer.add_block_count(int(cfg.num_hidden_layers))
    writer.add_feed_forward_length(int(cfg.intermediate_size))
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    rope_theta = getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    writer.add_rope_freq_base(float(rope_theta))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    writer.add_tokenizer_model("llama")
    specials = {0: "<unk>", 1: "<s>", 2: "</s>"}
    writer.add_token_list([specials.get(i, f"t{i}") for i in range(vocab)])
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types([gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL for i in range(vocab)])
    eos = cfg.eos_token_id if not isinstance(cfg.eos_token_id, (list, tuple)) else cfg.eos_token_id[0]
    writer.add_eos_token_id(int(eos if eos is not None else 2))
    writer.add_bos_token_id(int(cfg.bos_token_id if cfg.bos_token_id is not None else 1))

    def add(name: str, tensor: torch.Tensor, permute_heads: int = 0) -> None:
        array = tensor.detach().float().cpu().numpy()
        if permute_heads:
            array = _rope_permute(array, permute_heads)
        # Norm weights stay float32 (llama.cpp's converters do the same).
        writer.add_tensor(name, array.astype(np.float32 if array.ndim == 1 else np_dtype))

    decoder = model.get_decoder()
    add("token_embd.weight", decoder.embed_tokens.weight)
    for i, layer in enumerate(decoder.layers):
        att, mlp = layer.self_attn, layer.mlp
        add(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight)
        add(f"blk.{i}.attn_q.weight", att.q_proj.weight, permute_heads=n_head)
        add(f"blk.{i}.attn_k.weight", att.k_proj.weight, permute_heads=n_kv)
        add(f"blk.{i}.attn_v.weight", att.v_proj.weight)
        add(f"blk.{i}.attn_output.weight", att.o_proj.weight)
        add(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight)
        add(f"blk.{i}.ffn_gate.weight", mlp.gate_proj.weight)
        add(f"blk.{i}.ffn_up.weight", mlp.up_proj.weight)
        add(f"blk.{i}.ffn_down.weight", mlp.down_proj.weight)
    add("output_norm.weight", decoder.norm.weight)
    add("output.weight", model.get_output_embeddings().weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
