from protos.voicechat.v1 import snapshot_pb2 as _snapshot_pb2
from protos.voicechat.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefixPrecision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFIX_PRECISION_UNSPECIFIED: _ClassVar[PrefixPrecision]
    PREFIX_PRECISION_FLOAT32: _ClassVar[PrefixPrecision]
    PREFIX_PRECISION_BFLOAT16: _ClassVar[PrefixPrecision]
PREFIX_PRECISION_UNSPECIFIED: PrefixPrecision
PREFIX_PRECISION_FLOAT32: PrefixPrecision
PREFIX_PRECISION_BFLOAT16: PrefixPrecision

class LanguageOpen(_message.Message):
    __slots__ = ("system_prompt", "prompt_token_ids", "full_history", "prefix_precision", "restore")
    SYSTEM_PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FULL_HISTORY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_PRECISION_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    system_prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    full_history: bool
    prefix_precision: PrefixPrecision
    restore: bool
    def __init__(self, system_prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., full_history: _Optional[bool] = ..., prefix_precision: _Optional[_Union[PrefixPrecision, str]] = ..., restore: _Optional[bool] = ...) -> None: ...

class LanguageStep(_message.Message):
    __slots__ = ("frame_index", "audio_embedding", "return_logits", "forced_function_token_id")
    FRAME_INDEX_FIELD_NUMBER: _ClassVar[int]
    AUDIO_EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGITS_FIELD_NUMBER: _ClassVar[int]
    FORCED_FUNCTION_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    frame_index: int
    audio_embedding: _tensor_pb2.Tensor
    return_logits: bool
    forced_function_token_id: int
    def __init__(self, frame_index: _Optional[int] = ..., audio_embedding: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., return_logits: _Optional[bool] = ..., forced_function_token_id: _Optional[int] = ...) -> None: ...

class LanguageStreamRequest(_message.Message):
    __slots__ = ("open", "step", "snapshot", "restore")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    open: LanguageOpen
    step: LanguageStep
    snapshot: _snapshot_pb2.SnapshotRequest
    restore: _snapshot_pb2.SnapshotPart
    def __init__(self, open: _Optional[_Union[LanguageOpen, _Mapping]] = ..., step: _Optional[_Union[LanguageStep, _Mapping]] = ..., snapshot: _Optional[_Union[_snapshot_pb2.SnapshotRequest, _Mapping]] = ..., restore: _Optional[_Union[_snapshot_pb2.SnapshotPart, _Mapping]] = ...) -> None: ...

class LanguageOpened(_message.Message):
    __slots__ = ("prompt_positions", "hidden_size", "prompt_embeds")
    PROMPT_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_EMBEDS_FIELD_NUMBER: _ClassVar[int]
    prompt_positions: int
    hidden_size: int
    prompt_embeds: _tensor_pb2.Tensor
    def __init__(self, prompt_positions: _Optional[int] = ..., hidden_size: _Optional[int] = ..., prompt_embeds: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class LanguageStepResult(_message.Message):
    __slots__ = ("frame_index", "text_token_id", "function_token_id", "text_logits", "function_logits")
    FRAME_INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_LOGITS_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_LOGITS_FIELD_NUMBER: _ClassVar[int]
    frame_index: int
    text_token_id: int
    function_token_id: int
    text_logits: _tensor_pb2.Tensor
    function_logits: _tensor_pb2.Tensor
    def __init__(self, frame_index: _Optional[int] = ..., text_token_id: _Optional[int] = ..., function_token_id: _Optional[int] = ..., text_logits: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., function_logits: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class LanguageStreamResponse(_message.Message):
    __slots__ = ("opened", "step", "snapshot")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    opened: LanguageOpened
    step: LanguageStepResult
    snapshot: _snapshot_pb2.SnapshotPart
    def __init__(self, opened: _Optional[_Union[LanguageOpened, _Mapping]] = ..., step: _Optional[_Union[LanguageStepResult, _Mapping]] = ..., snapshot: _Optional[_Union[_snapshot_pb2.SnapshotPart, _Mapping]] = ...) -> None: ...
