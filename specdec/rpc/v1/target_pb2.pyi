from specdec.rpc.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFT_KIND_UNSPECIFIED: _ClassVar[DraftKind]
    DRAFT_KIND_DETERMINISTIC: _ClassVar[DraftKind]
    DRAFT_KIND_SAMPLED: _ClassVar[DraftKind]
DRAFT_KIND_UNSPECIFIED: DraftKind
DRAFT_KIND_DETERMINISTIC: DraftKind
DRAFT_KIND_SAMPLED: DraftKind

class VerifyRequest(_message.Message):
    __slots__ = ("position", "draft_token_ids", "draft_probs", "sampling", "draft_kind")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DRAFT_KIND_FIELD_NUMBER: _ClassVar[int]
    position: _common_pb2.SessionPosition
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _common_pb2.DraftProbs
    sampling: _common_pb2.SamplingParams
    draft_kind: DraftKind
    def __init__(self, position: _Optional[_Union[_common_pb2.SessionPosition, _Mapping]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Union[_common_pb2.DraftProbs, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., draft_kind: _Optional[_Union[DraftKind, str]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("emitted_token_ids", "num_accepted", "num_drafted")
    EMITTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    emitted_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_accepted: int
    num_drafted: int
    def __init__(self, emitted_token_ids: _Optional[_Iterable[int]] = ..., num_accepted: _Optional[int] = ..., num_drafted: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("position", "max_tokens", "method", "sampling", "stop_token_ids")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    position: _common_pb2.SessionPosition
    max_tokens: int
    method: str
    sampling: _common_pb2.SamplingParams
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, position: _Optional[_Union[_common_pb2.SessionPosition, _Mapping]] = ..., max_tokens: _Optional[int] = ..., method: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("emitted_token_ids", "method", "target_forwards", "num_drafted", "num_accepted")
    EMITTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    TARGET_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    emitted_token_ids: _containers.RepeatedScalarFieldContainer[int]
    method: str
    target_forwards: int
    num_drafted: int
    num_accepted: int
    def __init__(self, emitted_token_ids: _Optional[_Iterable[int]] = ..., method: _Optional[str] = ..., target_forwards: _Optional[int] = ..., num_drafted: _Optional[int] = ..., num_accepted: _Optional[int] = ...) -> None: ...
