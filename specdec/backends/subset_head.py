"""Drafts on transformers whose output layer scores a frequent-token subset of the vocabulary
(FR-Spec style; the draft directories of specdec.drafts): the rest get logit -inf."""

from __future__ import annotations

import torch

from specdec.backends.hf import CausalLM, ForwardOutput, scatter_subset_logits
from specdec.backends.kv_cache import KVCache


class SubsetHeadLM(CausalLM):
    """A CausalLM whose output layer scores only `token_ids` (rows of the target's output layer)."""

    def __init__(self, model: torch.nn.Module, token_ids: torch.Tensor, name: str = "draft"):
        super().__init__(model, name=name)
        self.token_ids = token_ids.long()  # [subset]
        self.head_rows = self.token_ids
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self._head = model.get_output_embeddings().weight[self.token_ids].detach().clone()  # [subset, hidden]

    def cost_identity(self) -> dict:
        return {**super().cost_identity(), "head_rows": int(self.token_ids.numel())}

    @torch.inference_mode()
    def forward(self, cache: KVCache, input_ids, block_mask=None, depth=None, input_valid=None, logits_at=None,
                want_hidden: bool = False) -> ForwardOutput:
        mask, positions = self._attention_inputs(cache, input_ids, block_mask, depth, input_valid)
        out = self.model.get_decoder()(input_ids=input_ids.to(self.device), attention_mask=mask,
                                       position_ids=positions, cache=cache.hf, use_cache=True)
        cache.appended(input_valid if input_valid is not None else torch.ones_like(input_ids, dtype=torch.bool))
        hidden = out.last_hidden_state  # [batch, q, hidden]
        h = hidden if logits_at is None else hidden[:, logits_at.to(hidden.device)]
        logits = scatter_subset_logits(h @ self._head.T, self.token_ids, self.vocab_size)  # [batch, q', vocab]
        return ForwardOutput(logits=logits, hidden=hidden if want_hidden else None)
