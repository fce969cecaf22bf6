from protos.voicechat.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ToolChoice(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_CHOICE_UNSPECIFIED: _ClassVar[ToolChoice]
    TOOL_CHOICE_AUTO: _ClassVar[ToolChoice]
    TOOL_CHOICE_NONE: _ClassVar[ToolChoice]

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    ERROR_CODE_INVALID_REQUEST: _ClassVar[ErrorCode]
    ERROR_CODE_SESSION_INITIALIZATION_FAILED: _ClassVar[ErrorCode]
    ERROR_CODE_INFERENCE_ERROR: _ClassVar[ErrorCode]
    ERROR_CODE_LIMIT_EXCEEDED: _ClassVar[ErrorCode]
    ERROR_CODE_SERVER_BUSY: _ClassVar[ErrorCode]
    ERROR_CODE_SERVICE_UNAVAILABLE: _ClassVar[ErrorCode]
    ERROR_CODE_INVALID_FUNCTION_CALL: _ClassVar[ErrorCode]
TOOL_CHOICE_UNSPECIFIED: ToolChoice
TOOL_CHOICE_AUTO: ToolChoice
TOOL_CHOICE_NONE: ToolChoice
ERROR_CODE_UNSPECIFIED: ErrorCode
ERROR_CODE_INVALID_REQUEST: ErrorCode
ERROR_CODE_SESSION_INITIALIZATION_FAILED: ErrorCode
ERROR_CODE_INFERENCE_ERROR: ErrorCode
ERROR_CODE_LIMIT_EXCEEDED: ErrorCode
ERROR_CODE_SERVER_BUSY: ErrorCode
ERROR_CODE_SERVICE_UNAVAILABLE: ErrorCode
ERROR_CODE_INVALID_FUNCTION_CALL: ErrorCode

class ConverseRequest(_message.Message):
    __slots__ = ("configure", "audio", "flush", "cancel", "function_call_output")
    CONFIGURE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    FLUSH_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_CALL_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    configure: Configure
    audio: AudioIn
    flush: Flush
    cancel: Cancel
    function_call_output: FunctionCallOutput
    def __init__(self, configure: _Optional[_Union[Configure, _Mapping]] = ..., audio: _Optional[_Union[AudioIn, _Mapping]] = ..., flush: _Optional[_Union[Flush, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ..., function_call_output: _Optional[_Union[FunctionCallOutput, _Mapping]] = ...) -> None: ...

class Configure(_message.Message):
    __slots__ = ("system_prompt", "seed", "max_streaming_seconds", "sample_rate_hz", "tools", "tool_choice")
    SYSTEM_PROMPT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_STREAMING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    system_prompt: str
    seed: int
    max_streaming_seconds: float
    sample_rate_hz: int
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: ToolChoice
    def __init__(self, system_prompt: _Optional[str] = ..., seed: _Optional[int] = ..., max_streaming_seconds: _Optional[float] = ..., sample_rate_hz: _Optional[int] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[_Union[ToolChoice, str]] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ...) -> None: ...

class FunctionCallOutput(_message.Message):
    __slots__ = ("call_id", "output")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    output: str
    def __init__(self, call_id: _Optional[str] = ..., output: _Optional[str] = ...) -> None: ...

class AudioIn(_message.Message):
    __slots__ = ("pcm16", "float32", "sample_rate_hz")
    PCM16_FIELD_NUMBER: _ClassVar[int]
    FLOAT32_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    pcm16: bytes
    float32: _tensor_pb2.Tensor
    sample_rate_hz: int
    def __init__(self, pcm16: _Optional[bytes] = ..., float32: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., sample_rate_hz: _Optional[int] = ...) -> None: ...

class Flush(_message.Message):
    __slots__ = ("pad_partial",)
    PAD_PARTIAL_FIELD_NUMBER: _ClassVar[int]
    pad_partial: bool
    def __init__(self, pad_partial: _Optional[bool] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ConverseResponse(_message.Message):
    __slots__ = ("ready", "transcript", "text", "function", "audio", "done", "cancelled", "error", "function_call_delta", "function_call_done", "function_call_output")
    READY_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_CALL_DELTA_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_CALL_DONE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_CALL_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ready: SessionReady
    transcript: TranscriptDelta
    text: TextDelta
    function: TextDelta
    audio: AudioOut
    done: Done
    cancelled: Cancelled
    error: Error
    function_call_delta: FunctionCallDelta
    function_call_done: FunctionCallDone
    function_call_output: FunctionCallOutputAdded
    def __init__(self, ready: _Optional[_Union[SessionReady, _Mapping]] = ..., transcript: _Optional[_Union[TranscriptDelta, _Mapping]] = ..., text: _Optional[_Union[TextDelta, _Mapping]] = ..., function: _Optional[_Union[TextDelta, _Mapping]] = ..., audio: _Optional[_Union[AudioOut, _Mapping]] = ..., done: _Optional[_Union[Done, _Mapping]] = ..., cancelled: _Optional[_Union[Cancelled, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., function_call_delta: _Optional[_Union[FunctionCallDelta, _Mapping]] = ..., function_call_done: _Optional[_Union[FunctionCallDone, _Mapping]] = ..., function_call_output: _Optional[_Union[FunctionCallOutputAdded, _Mapping]] = ...) -> None: ...

class FunctionCallDelta(_message.Message):
    __slots__ = ("frame_index", "call_id", "delta")
    FRAME_INDEX_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    frame_index: int
    call_id: str
    delta: str
    def __init__(self, frame_index: _Optional[int] = ..., call_id: _Optional[str] = ..., delta: _Optional[str] = ...) -> None: ...

class FunctionCallDone(_message.Message):
    __slots__ = ("frame_index", "call_id", "name", "arguments")
    FRAME_INDEX_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    frame_index: int
    call_id: str
    name: str
    arguments: str
    def __init__(self, frame_index: _Optional[int] = ..., call_id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class FunctionCallOutputAdded(_message.Message):
    __slots__ = ("frame_index", "call_id", "name", "output")
    FRAME_INDEX_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    frame_index: int
    call_id: str
    name: str
    output: str
    def __init__(self, frame_index: _Optional[int] = ..., call_id: _Optional[str] = ..., name: _Optional[str] = ..., output: _Optional[str] = ...) -> None: ...

class SessionReady(_message.Message):
    __slots__ = ("session_id", "frame_samples", "output_sample_rate_hz", "input_sample_rate_hz")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FRAME_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    INPUT_SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    frame_samples: int
    output_sample_rate_hz: int
    input_sample_rate_hz: int
    def __init__(self, session_id: _Optional[str] = ..., frame_samples: _Optional[int] = ..., output_sample_rate_hz: _Optional[int] = ..., input_sample_rate_hz: _Optional[int] = ...) -> None: ...

class TranscriptDelta(_message.Message):
    __slots__ = ("frame_index", "delta", "transcript", "transcript_start")
    FRAME_INDEX_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_START_FIELD_NUMBER: _ClassVar[int]
    frame_index: int
    delta: str
    transcript: str
    transcript_start: int
    def __init__(self, frame_index: _Optional[int] = ..., delta: _Optional[str] = ..., transcript: _Optional[str] = ..., transcript_start: _Optional[int] = ...) -> None: ...

class TextDelta(_message.Message):
    __slots__ = ("frame_index", "token_id", "delta", "text", "text_start")
    FRAME_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TEXT_START_FIELD_NUMBER: _ClassVar[int]
    frame_index: int
    token_id: int
    delta: str
    text: str
    text_start: int
    def __init__(self, frame_index: _Optional[int] = ..., token_id: _Optional[int] = ..., delta: _Optional[str] = ..., text: _Optional[str] = ..., text_start: _Optional[int] = ...) -> None: ...

class AudioOut(_message.Message):
    __slots__ = ("frame_index", "samples", "audio_codes", "sample_rate_hz", "raw_codes")
    FRAME_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    AUDIO_CODES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    RAW_CODES_FIELD_NUMBER: _ClassVar[int]
    frame_index: int
    samples: _tensor_pb2.Tensor
    audio_codes: _containers.RepeatedScalarFieldContainer[int]
    sample_rate_hz: int
    raw_codes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, frame_index: _Optional[int] = ..., samples: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., audio_codes: _Optional[_Iterable[int]] = ..., sample_rate_hz: _Optional[int] = ..., raw_codes: _Optional[_Iterable[int]] = ...) -> None: ...

class Done(_message.Message):
    __slots__ = ("frame_index",)
    FRAME_INDEX_FIELD_NUMBER: _ClassVar[int]
    frame_index: int
    def __init__(self, frame_index: _Optional[int] = ...) -> None: ...

class Cancelled(_message.Message):
    __slots__ = ("frame_index",)
    FRAME_INDEX_FIELD_NUMBER: _ClassVar[int]
    frame_index: int
    def __init__(self, frame_index: _Optional[int] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: ErrorCode
    message: str
    def __init__(self, code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ...) -> None: ...
