"""What every backend declares about itself: the model interface the engine, the proposers and the
services' cores run, and the capabilities they read instead of probing types or attributes.

Backends (one module each): hf (any transformers causal LM: specdec.backends.hf.CausalLM), fast
(specdec's own Llama forward over the same weights), llamacpp (a GGUF file on llama.cpp),
subset_head (drafts scoring a frequent-token subset on transformers); the measured choice between
them: specdec.backends.choice.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence, runtime_checkable


@runtime_checkable
class ModelBackend(Protocol):
    """A causal LM behind the engine's interface (see CausalLM for the full signatures)."""

    name: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_positions: int
    backend: str  # "hf", "fast", "fast-bf16" or "llamacpp": what runs the forward
    head_rows: Optional[Any]  # token ids the output layer scores ([subset] tensor), None: the whole vocabulary
    # --- capabilities ---
    returns_hidden: bool  # forward(want_hidden=True) gives the last hidden state (Medusa heads, EAGLE read it)
    returns_taps: bool  # forward/prefill(tap_layers=...) give inner layers' residuals too (EAGLE drafts with taps)
    runs_trees: bool  # forward takes tree blocks (block_mask); False: causal chains only
    stacks_caches: bool  # batch-1 caches stack into one batched cache (kv_stack); False: run side by side (run_each)
    greedy_steps: bool  # greedy_step(cache, token) -> next greedy token, the argmax on the backend's side
    # A restored prefix continues bit for bit as a fresh prefill only at multiples of this many tokens, its
    # rows prefilled in whole blocks of it from position 0 (specdec.prefix_cache). 1: any prefix (torch).
    prefill_block: int

    def new_cache(self, batch_size: int) -> Any: ...

    def prefill(self, cache: Any, prompts: Sequence[Sequence[int]], want_hidden: bool = False,
                all_hidden: bool = False) -> Any: ...

    def forward(self, cache: Any, input_ids: Any, block_mask: Any = None, depth: Any = None, input_valid: Any = None,
                logits_at: Any = None, want_hidden: bool = False) -> Any: ...

    def cost_identity(self) -> dict: ...

    def embedding_tables(self) -> tuple[Any, Any]: ...  # (input embeddings, output layer), each [vocab, hidden]

    def output_bias(self) -> Optional[Any]: ...  # [vocab], None where the output layer has none
