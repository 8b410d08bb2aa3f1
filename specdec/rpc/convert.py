"""Conversion between protobuf messages and the core's dataclasses, in one place.

Draft probabilities travel only when sampling needs them: as the sparse support of each row
when top-k / top-p left few tokens, else as packed little-endian float32. Both round-trip the
float32 values exactly, so rejection sampling on the target sees the draft's own numbers.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from specdec.errors import InvalidRequest
from specdec.rpc.v1 import common_pb2, target_pb2
from specdec.sessions import check_token_ids, token_digest
from specdec.types import DraftKind, SamplingParams

# --- sampling ----------------------------------------------------------------------------------

def sampling_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def sampling_from_pb(msg: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p or 1.0,
                          seed=msg.seed if msg.HasField("seed") else None)


# --- draft kinds ------------------------------------------------------------------------------

_DRAFT_KINDS = {DraftKind.DETERMINISTIC: target_pb2.DRAFT_KIND_DETERMINISTIC,
                DraftKind.SAMPLED: target_pb2.DRAFT_KIND_SAMPLED}


def draft_kind_to_pb(kind: DraftKind) -> int:
    return _DRAFT_KINDS[kind]


def draft_kind_from_pb(value: int) -> Optional[DraftKind]:
    """-> the kind, or None when the caller left it unspecified."""
    if value == target_pb2.DRAFT_KIND_UNSPECIFIED:
        return None
    for kind, pb in _DRAFT_KINDS.items():
        if pb == value:
            return kind
    raise InvalidRequest(f"unknown draft_kind {value}")


# --- session positions -------------------------------------------------------------------------

def position_to_pb(session_id: str, committed: Sequence[int], known_len: int,
                   digest: Optional[int] = None) -> common_pb2.SessionPosition:
    """The position after `committed`, sending the tokens past the first known_len (what the service
    has). digest: token_digest(committed) where the caller keeps it (sessions.PrefixDigests)."""
    return common_pb2.SessionPosition(session_id=session_id, committed_len=len(committed),
                                      new_token_ids=list(committed[known_len:]),
                                      committed_digest=token_digest(committed) if digest is None else digest)


# --- draft probabilities -----------------------------------------------------------------------

def draft_probs_to_pb(draft_probs: torch.Tensor) -> common_pb2.DraftProbs:
    """draft_probs [k, vocab] float -> sparse rows when the supports are small, else packed float32."""
    probs = draft_probs.detach().to(torch.float32).cpu()
    k, vocab = probs.shape
    nonzero = int((probs > 0).sum())
    msg = common_pb2.DraftProbs(vocab_size=vocab)
    if nonzero * 2 < k * vocab:  # a sparse entry costs two numbers
        rows = []
        for row in probs:
            idx = row.nonzero().squeeze(-1)
            rows.append(common_pb2.SparseRow(token_ids=idx.tolist(), probs=row[idx].tolist()))
        msg.sparse.CopyFrom(common_pb2.SparseRows(rows=rows))
    else:
        msg.dense_f32 = probs.numpy().astype("<f4").tobytes()
    return msg


def draft_probs_from_pb(msg: common_pb2.DraftProbs, k: int, vocab_size: int) -> Optional[torch.Tensor]:
    """-> [k, vocab] float32, or None when the message carries none."""
    which = msg.WhichOneof("encoding")
    if which is None:
        return None
    if msg.vocab_size != vocab_size:
        raise InvalidRequest(f"draft_probs vocabulary {msg.vocab_size} differs from the target's {vocab_size}")
    if which == "dense_f32":
        if len(msg.dense_f32) != 4 * k * vocab_size:
            raise InvalidRequest(f"draft_probs must hold {k} x {vocab_size} float32 values")
        return torch.from_numpy(np.frombuffer(msg.dense_f32, dtype="<f4").astype(np.float32).reshape(k, vocab_size))
    rows = msg.sparse.rows
    if len(rows) != k:
        raise InvalidRequest(f"draft_probs has {len(rows)} rows for {k} drafted tokens")
    out = torch.zeros(k, vocab_size, dtype=torch.float32)
    for i, row in enumerate(rows):
        if len(row.token_ids) != len(row.probs):
            raise InvalidRequest("a sparse draft_probs row needs one probability per token id")
        ids = check_token_ids(row.token_ids, vocab_size, "draft_probs token ids")
        out[i, ids] = torch.tensor(list(row.probs), dtype=torch.float32)
    return out
