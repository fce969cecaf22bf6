from protos.voicechat.v1 import snapshot_pb2 as _snapshot_pb2
from protos.voicechat.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeRequest(_message.Message):
    __slots__ = ("waveform", "sample_rate_hz")
    WAVEFORM_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    waveform: _tensor_pb2.Tensor
    sample_rate_hz: int
    def __init__(self, waveform: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., sample_rate_hz: _Optional[int] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("mel", "encoder_output", "audio_embeds", "transcript", "transcript_token_ids", "frames")
    MEL_FIELD_NUMBER: _ClassVar[int]
    ENCODER_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    AUDIO_EMBEDS_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    mel: _tensor_pb2.Tensor
    encoder_output: _tensor_pb2.Tensor
    audio_embeds: _tensor_pb2.Tensor
    transcript: str
    transcript_token_ids: _containers.RepeatedScalarFieldContainer[int]
    frames: int
    def __init__(self, mel: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., encoder_output: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., audio_embeds: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., transcript: _Optional[str] = ..., transcript_token_ids: _Optional[_Iterable[int]] = ..., frames: _Optional[int] = ...) -> None: ...

class PerceptionOpen(_message.Message):
    __slots__ = ("sample_rate_hz", "session_label", "restore")
    SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    SESSION_LABEL_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    sample_rate_hz: int
    session_label: str
    restore: bool
    def __init__(self, sample_rate_hz: _Optional[int] = ..., session_label: _Optional[str] = ..., restore: _Optional[bool] = ...) -> None: ...

class PerceptionFrameInput(_message.Message):
    __slots__ = ("frame_index", "samples")
    FRAME_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    frame_index: int
    samples: _tensor_pb2.Tensor
    def __init__(self, frame_index: _Optional[int] = ..., samples: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class PerceptionStreamRequest(_message.Message):
    __slots__ = ("open", "frame", "snapshot", "restore")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    open: PerceptionOpen
    frame: PerceptionFrameInput
    snapshot: _snapshot_pb2.SnapshotRequest
    restore: _snapshot_pb2.SnapshotPart
    def __init__(self, open: _Optional[_Union[PerceptionOpen, _Mapping]] = ..., frame: _Optional[_Union[PerceptionFrameInput, _Mapping]] = ..., snapshot: _Optional[_Union[_snapshot_pb2.SnapshotRequest, _Mapping]] = ..., restore: _Optional[_Union[_snapshot_pb2.SnapshotPart, _Mapping]] = ...) -> None: ...

class PerceptionOpened(_message.Message):
    __slots__ = ("frame_samples", "embedding_dim")
    FRAME_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DIM_FIELD_NUMBER: _ClassVar[int]
    frame_samples: int
    embedding_dim: int
    def __init__(self, frame_samples: _Optional[int] = ..., embedding_dim: _Optional[int] = ...) -> None: ...

class PerceptionFrame(_message.Message):
    __slots__ = ("frame_index", "audio_embedding", "encoder_output", "transcript_delta", "transcript", "token_ids")
    FRAME_INDEX_FIELD_NUMBER: _ClassVar[int]
    AUDIO_EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    ENCODER_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_DELTA_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    frame_index: int
    audio_embedding: _tensor_pb2.Tensor
    encoder_output: _tensor_pb2.Tensor
    transcript_delta: str
    transcript: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, frame_index: _Optional[int] = ..., audio_embedding: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., encoder_output: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., transcript_delta: _Optional[str] = ..., transcript: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PerceptionStreamResponse(_message.Message):
    __slots__ = ("opened", "frame", "snapshot")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    opened: PerceptionOpened
    frame: PerceptionFrame
    snapshot: _snapshot_pb2.SnapshotPart
    def __init__(self, opened: _Optional[_Union[PerceptionOpened, _Mapping]] = ..., frame: _Optional[_Union[PerceptionFrame, _Mapping]] = ..., snapshot: _Optional[_Union[_snapshot_pb2.SnapshotPart, _Mapping]] = ...) -> None: ...
