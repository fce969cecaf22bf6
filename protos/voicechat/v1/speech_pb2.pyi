from protos.voicechat.v1 import snapshot_pb2 as _snapshot_pb2
from protos.voicechat.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SpeechDescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SpeechDescribeResponse(_message.Message):
    __slots__ = ("prompt_frames", "num_quantizers", "codebook_size", "control_codes", "silence_codes")
    PROMPT_FRAMES_FIELD_NUMBER: _ClassVar[int]
    NUM_QUANTIZERS_FIELD_NUMBER: _ClassVar[int]
    CODEBOOK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTROL_CODES_FIELD_NUMBER: _ClassVar[int]
    SILENCE_CODES_FIELD_NUMBER: _ClassVar[int]
    prompt_frames: int
    num_quantizers: int
    codebook_size: int
    control_codes: _containers.RepeatedScalarFieldContainer[int]
    silence_codes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt_frames: _Optional[int] = ..., num_quantizers: _Optional[int] = ..., codebook_size: _Optional[int] = ..., control_codes: _Optional[_Iterable[int]] = ..., silence_codes: _Optional[_Iterable[int]] = ...) -> None: ...

class SpeechOpen(_message.Message):
    __slots__ = ("seed", "prompt_codes", "prefix_steps", "restore")
    SEED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CODES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_STEPS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    seed: int
    prompt_codes: _tensor_pb2.Tensor
    prefix_steps: int
    restore: bool
    def __init__(self, seed: _Optional[int] = ..., prompt_codes: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., prefix_steps: _Optional[int] = ..., restore: _Optional[bool] = ...) -> None: ...

class SpeechStep(_message.Message):
    __slots__ = ("frame_index", "text_token_id")
    FRAME_INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    frame_index: int
    text_token_id: int
    def __init__(self, frame_index: _Optional[int] = ..., text_token_id: _Optional[int] = ...) -> None: ...

class SpeechStreamRequest(_message.Message):
    __slots__ = ("open", "step", "snapshot", "restore")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    open: SpeechOpen
    step: SpeechStep
    snapshot: _snapshot_pb2.SnapshotRequest
    restore: _snapshot_pb2.SnapshotPart
    def __init__(self, open: _Optional[_Union[SpeechOpen, _Mapping]] = ..., step: _Optional[_Union[SpeechStep, _Mapping]] = ..., snapshot: _Optional[_Union[_snapshot_pb2.SnapshotRequest, _Mapping]] = ..., restore: _Optional[_Union[_snapshot_pb2.SnapshotPart, _Mapping]] = ...) -> None: ...

class SpeechOpened(_message.Message):
    __slots__ = ("prompt_frames",)
    PROMPT_FRAMES_FIELD_NUMBER: _ClassVar[int]
    prompt_frames: int
    def __init__(self, prompt_frames: _Optional[int] = ...) -> None: ...

class SpeechStepResult(_message.Message):
    __slots__ = ("frame_index", "codes", "clean_codes")
    FRAME_INDEX_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    CLEAN_CODES_FIELD_NUMBER: _ClassVar[int]
    frame_index: int
    codes: _tensor_pb2.Tensor
    clean_codes: _tensor_pb2.Tensor
    def __init__(self, frame_index: _Optional[int] = ..., codes: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., clean_codes: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class SpeechStreamResponse(_message.Message):
    __slots__ = ("opened", "step", "snapshot")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    opened: SpeechOpened
    step: SpeechStepResult
    snapshot: _snapshot_pb2.SnapshotPart
    def __init__(self, opened: _Optional[_Union[SpeechOpened, _Mapping]] = ..., step: _Optional[_Union[SpeechStepResult, _Mapping]] = ..., snapshot: _Optional[_Union[_snapshot_pb2.SnapshotPart, _Mapping]] = ...) -> None: ...
