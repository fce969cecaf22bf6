from protos.voicechat.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SnapshotRequest(_message.Message):
    __slots__ = ("base",)
    BASE_FIELD_NUMBER: _ClassVar[int]
    base: int
    def __init__(self, base: _Optional[int] = ...) -> None: ...

class SnapshotSlice(_message.Message):
    __slots__ = ("axis", "start", "length")
    AXIS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    axis: int
    start: int
    length: int
    def __init__(self, axis: _Optional[int] = ..., start: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class SnapshotEntry(_message.Message):
    __slots__ = ("name", "tensor", "text", "offset", "slice")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SLICE_FIELD_NUMBER: _ClassVar[int]
    name: str
    tensor: _tensor_pb2.Tensor
    text: str
    offset: int
    slice: SnapshotSlice
    def __init__(self, name: _Optional[str] = ..., tensor: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., text: _Optional[str] = ..., offset: _Optional[int] = ..., slice: _Optional[_Union[SnapshotSlice, _Mapping]] = ...) -> None: ...

class SnapshotPart(_message.Message):
    __slots__ = ("entries", "last", "id", "base")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[SnapshotEntry]
    last: bool
    id: int
    base: int
    def __init__(self, entries: _Optional[_Iterable[_Union[SnapshotEntry, _Mapping]]] = ..., last: _Optional[bool] = ..., id: _Optional[int] = ..., base: _Optional[int] = ...) -> None: ...
