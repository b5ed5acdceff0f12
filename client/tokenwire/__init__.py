"""tokenwire: a client for the tokenwire.v1.TextGeneration gRPC service.

The base install (grpcio, protobuf) is all a caller needs; the generated stubs live
in ``tokenwire.v1``.

    import tokenwire

    with tokenwire.Client("localhost:50051") as client:
        for chunk in client.generate("Once upon a time", max_new_tokens=32):
            print(chunk.text, end="", flush=True)
"""

from tokenwire.aio import AsyncChunkStream, AsyncClient
from tokenwire.channel import TLSConfig
from tokenwire.client import ChunkStream, Client
from tokenwire.errors import (
    Aborted,
    AlreadyExists,
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    OutOfRange,
    Overloaded,
    PermissionDenied,
    TokenwireError,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    Unknown,
)
from tokenwire.formats import IncompleteAnswer
from tokenwire.request import GenerateOptions
from tokenwire.results import (
    Chunk,
    Completion,
    FinishReason,
    HealthStatus,
    Message,
    ModelInfo,
    Offset,
    Score,
    Token,
    Tokenization,
    TopLogprob,
    Usage,
)
from tokenwire.retry import NO_RETRY, RetryPolicy
from tokenwire.validation import FieldViolation, Limits

__version__ = "0.1.0"

__all__ = [
    "NO_RETRY",
    "Aborted",
    "AlreadyExists",
    "AsyncChunkStream",
    "AsyncClient",
    "Cancelled",
    "Chunk",
    "ChunkStream",
    "Client",
    "Completion",
    "DataLoss",
    "DeadlineExceeded",
    "FailedPrecondition",
    "FieldViolation",
    "FinishReason",
    "GenerateOptions",
    "IncompleteAnswer",
    "HealthStatus",
    "Internal",
    "InvalidArgument",
    "Limits",
    "Message",
    "ModelInfo",
    "NotFound",
    "Offset",
    "Score",
    "OutOfRange",
    "Overloaded",
    "PermissionDenied",
    "RetryPolicy",
    "TLSConfig",
    "Token",
    "Tokenization",
    "TokenwireError",
    "TopLogprob",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "Unknown",
    "Usage",
    "__version__",
]
