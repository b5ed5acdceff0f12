"""TLS and mutual TLS credentials, and the bearer-token interceptor.

The interceptor handles every RPC kind (streaming included) and exempts the
health service, so Kubernetes probes keep working without the token.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:  # generic only in the type stubs
    Handler = grpc.RpcMethodHandler[Any, Any]
    Context = grpc.aio.ServicerContext[Any, Any]

HEALTH_PREFIX = "/grpc.health.v1.Health/"


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials:
    chain = Path(cert).read_bytes()
    private_key = Path(key).read_bytes()
    if client_ca:
        return grpc.ssl_server_credentials(
            [(private_key, chain)], root_certificates=Path(client_ca).read_bytes(), require_client_auth=True
        )
    return grpc.ssl_server_credentials([(private_key, chain)])


def read_token(path: str) -> str:
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"--auth-token-file {path} is empty")
    return token


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str, exempt_prefixes: tuple[str, ...] = (HEALTH_PREFIX,)) -> None:
        self._expected = f"Bearer {token}".encode()
        self._exempt = exempt_prefixes

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        method = handler_call_details.method
        if method.startswith(self._exempt):
            return await continuation(handler_call_details)
        presented = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                presented = value if isinstance(value, str) else value.decode()
        handler = await continuation(handler_call_details)
        if hmac.compare_digest(presented.encode(), self._expected):
            return handler
        return _refusing(handler, "missing or wrong bearer token (metadata 'authorization: Bearer <token>')")


def _refusing(handler: Handler | None, message: str) -> Handler:
    async def refuse(request: Any, context: Context) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler is None:
        return grpc.unary_unary_rpc_method_handler(refuse)
    args: dict[str, Any] = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse, **args)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse, **args)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, **args)
    return grpc.stream_stream_rpc_method_handler(refuse, **args)
