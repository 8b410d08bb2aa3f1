from specdec.rpc.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposeRequest(_message.Message):
    __slots__ = ("position", "k", "sampling", "with_guess")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    WITH_GUESS_FIELD_NUMBER: _ClassVar[int]
    position: _common_pb2.SessionPosition
    k: int
    sampling: _common_pb2.SamplingParams
    with_guess: bool
    def __init__(self, position: _Optional[_Union[_common_pb2.SessionPosition, _Mapping]] = ..., k: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., with_guess: _Optional[bool] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("token_ids", "draft_probs", "guess")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    GUESS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _common_pb2.DraftProbs
    guess: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Union[_common_pb2.DraftProbs, _Mapping]] = ..., guess: _Optional[int] = ...) -> None: ...
