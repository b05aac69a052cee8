from proto import step_pb2 as _step_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("rank", "world_size", "num_blocks", "block_size", "device", "dtype", "kv_cache_bytes", "pid")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world_size: int
    num_blocks: int
    block_size: int
    device: str
    dtype: str
    kv_cache_bytes: int
    pid: int
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., kv_cache_bytes: _Optional[int] = ..., pid: _Optional[int] = ...) -> None: ...
