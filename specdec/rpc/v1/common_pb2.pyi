from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class SessionPosition(_message.Message):
    __slots__ = ("session_id", "committed_len", "new_token_ids", "committed_digest")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_DIGEST_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    committed_len: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    committed_digest: int
    def __init__(self, session_id: _Optional[str] = ..., committed_len: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., committed_digest: _Optional[int] = ...) -> None: ...

class DraftProbs(_message.Message):
    __slots__ = ("vocab_size", "sparse", "dense_f32")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    DENSE_F32_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    sparse: SparseRows
    dense_f32: bytes
    def __init__(self, vocab_size: _Optional[int] = ..., sparse: _Optional[_Union[SparseRows, _Mapping]] = ..., dense_f32: _Optional[bytes] = ...) -> None: ...

class SparseRows(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[SparseRow]
    def __init__(self, rows: _Optional[_Iterable[_Union[SparseRow, _Mapping]]] = ...) -> None: ...

class SparseRow(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("session_id", "token_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("cached_len",)
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    cached_len: int
    def __init__(self, cached_len: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "vocab_size", "eos_token_ids", "max_positions", "tokenizer_files", "methods", "max_k", "drafting_cannot_pay", "verify_cost")
    class TokenizerFilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    class VerifyCostEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FILES_FIELD_NUMBER: _ClassVar[int]
    METHODS_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    DRAFTING_CANNOT_PAY_FIELD_NUMBER: _ClassVar[int]
    VERIFY_COST_FIELD_NUMBER: _ClassVar[int]
    name: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_positions: int
    tokenizer_files: _containers.ScalarMap[str, bytes]
    methods: _containers.RepeatedScalarFieldContainer[str]
    max_k: int
    drafting_cannot_pay: bool
    verify_cost: _containers.ScalarMap[int, float]
    def __init__(self, name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_positions: _Optional[int] = ..., tokenizer_files: _Optional[_Mapping[str, bytes]] = ..., methods: _Optional[_Iterable[str]] = ..., max_k: _Optional[int] = ..., drafting_cannot_pay: _Optional[bool] = ..., verify_cost: _Optional[_Mapping[int, float]] = ...) -> None: ...
