from protos.voicechat.v1 import snapshot_pb2 as _snapshot_pb2
from protos.voicechat.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PromptCodesRequest(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: int
    def __init__(self, frames: _Optional[int] = ...) -> None: ...

class PromptCodesResponse(_message.Message):
    __slots__ = ("codes",)
    CODES_FIELD_NUMBER: _ClassVar[int]
    codes: _tensor_pb2.Tensor
    def __init__(self, codes: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class CodecEncodeRequest(_message.Message):
    __slots__ = ("waveform", "sample_rate_hz")
    WAVEFORM_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    waveform: _tensor_pb2.Tensor
    sample_rate_hz: int
    def __init__(self, waveform: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., sample_rate_hz: _Optional[int] = ...) -> None: ...

class CodecEncodeResponse(_message.Message):
    __slots__ = ("codes",)
    CODES_FIELD_NUMBER: _ClassVar[int]
    codes: _tensor_pb2.Tensor
    def __init__(self, codes: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class CodecDecodeRequest(_message.Message):
    __slots__ = ("codes",)
    CODES_FIELD_NUMBER: _ClassVar[int]
    codes: _tensor_pb2.Tensor
    def __init__(self, codes: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class CodecDecodeResponse(_message.Message):
    __slots__ = ("waveform", "sample_rate_hz")
    WAVEFORM_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    waveform: _tensor_pb2.Tensor
    sample_rate_hz: int
    def __init__(self, waveform: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., sample_rate_hz: _Optional[int] = ...) -> None: ...

class CodecDecodeOpen(_message.Message):
    __slots__ = ("restore",)
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    restore: bool
    def __init__(self, restore: _Optional[bool] = ...) -> None: ...

class CodecDecodeFrameInput(_message.Message):
    __slots__ = ("frame_index", "codes")
    FRAME_INDEX_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    frame_index: int
    codes: _tensor_pb2.Tensor
    def __init__(self, frame_index: _Optional[int] = ..., codes: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class CodecDecodeStreamRequest(_message.Message):
    __slots__ = ("open", "frame", "snapshot", "restore")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    open: CodecDecodeOpen
    frame: CodecDecodeFrameInput
    snapshot: _snapshot_pb2.SnapshotRequest
    restore: _snapshot_pb2.SnapshotPart
    def __init__(self, open: _Optional[_Union[CodecDecodeOpen, _Mapping]] = ..., frame: _Optional[_Union[CodecDecodeFrameInput, _Mapping]] = ..., snapshot: _Optional[_Union[_snapshot_pb2.SnapshotRequest, _Mapping]] = ..., restore: _Optional[_Union[_snapshot_pb2.SnapshotPart, _Mapping]] = ...) -> None: ...

class CodecDecodeOpened(_message.Message):
    __slots__ = ("samples_per_frame", "sample_rate_hz")
    SAMPLES_PER_FRAME_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    samples_per_frame: int
    sample_rate_hz: int
    def __init__(self, samples_per_frame: _Optional[int] = ..., sample_rate_hz: _Optional[int] = ...) -> None: ...

class CodecDecodedFrame(_message.Message):
    __slots__ = ("frame_index", "samples")
    FRAME_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    frame_index: int
    samples: _tensor_pb2.Tensor
    def __init__(self, frame_index: _Optional[int] = ..., samples: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class CodecDecodeStreamResponse(_message.Message):
    __slots__ = ("opened", "frame", "snapshot")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    opened: CodecDecodeOpened
    frame: CodecDecodedFrame
    snapshot: _snapshot_pb2.SnapshotPart
    def __init__(self, opened: _Optional[_Union[CodecDecodeOpened, _Mapping]] = ..., frame: _Optional[_Union[CodecDecodedFrame, _Mapping]] = ..., snapshot: _Optional[_Union[_snapshot_pb2.SnapshotPart, _Mapping]] = ...) -> None: ...
