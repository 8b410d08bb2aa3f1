from specdec.rpc.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "chat", "sampling", "max_tokens", "stop", "method", "k", "session_id", "resume_from")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    sampling: _common_pb2.SamplingParams
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    method: str
    k: int
    session_id: str
    resume_from: int
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., method: _Optional[str] = ..., k: _Optional[int] = ..., session_id: _Optional[str] = ..., resume_from: _Optional[int] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("tau", "alpha", "tokens_per_s", "target_forwards", "drafted", "accepted", "emitted", "fallback_steps", "pipeline_hits", "pipeline_misses", "elapsed_s")
    TAU_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    TARGET_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    EMITTED_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_STEPS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_HITS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_MISSES_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    tau: float
    alpha: float
    tokens_per_s: float
    target_forwards: int
    drafted: int
    accepted: int
    emitted: int
    fallback_steps: int
    pipeline_hits: int
    pipeline_misses: int
    elapsed_s: float
    def __init__(self, tau: _Optional[float] = ..., alpha: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., target_forwards: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., emitted: _Optional[int] = ..., fallback_steps: _Optional[int] = ..., pipeline_hits: _Optional[int] = ..., pipeline_misses: _Optional[int] = ..., elapsed_s: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("session_id", "text", "token_ids", "finish_reason", "stats", "prompt_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    stats: Stats
    prompt_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[Stats, _Mapping]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("session_id", "offset", "token_ids", "text", "finish_reason", "stats")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    offset: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    stats: Stats
    def __init__(self, session_id: _Optional[str] = ..., offset: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[Stats, _Mapping]] = ...) -> None: ...
