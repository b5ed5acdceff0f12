"""TLS and mutual TLS credentials, the bearer-token interceptor, and who a caller is.

The interceptor handles every RPC kind (streaming included) and exempts the
health service, so Kubernetes probes keep working without the token.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from .domain import DEFAULT_TENANT
from .tenancy import Tenants

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


def read_tokens(path: str) -> dict[str, str]:
    """``--auth-token-file``: one ``TOKEN [TENANT]`` per line (``#`` comments, blank lines
    skipped); a token without a tenant is the ``default`` tenant's. Token -> tenant."""
    tokens: dict[str, str] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 2:
            raise ValueError(f"--auth-token-file {path}:{number}: expected 'TOKEN [TENANT]', got {len(words)} words")
        token, tenant = words[0], words[1] if len(words) == 2 else DEFAULT_TENANT
        if token in tokens:
            raise ValueError(f"--auth-token-file {path}:{number}: this token is listed twice")
        tokens[token] = tenant
    if not tokens:
        raise ValueError(f"--auth-token-file {path} is empty")
    return tokens


def _bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode(errors="replace")
    return ""


class Identities:
    """Which tenant a call is: its bearer token's tenant, else its client certificate's common
    name, else ``default``; a name the tenant configuration does not know is ``default``."""

    def __init__(self, tenants: Tenants, tokens: Mapping[str, str] | None = None) -> None:
        self._tenants = tenants
        self._by_header = {f"Bearer {t}": name for t, name in (tokens or {}).items()}

    def tenant_of(self, context: Context) -> str:
        name = self._by_header.get(_bearer(context.invocation_metadata()), "")
        if not name:
            common_names = list(context.auth_context().get("x509_common_name") or ())
            name = common_names[0].decode(errors="replace") if common_names else ""
        return self._tenants.resolve(name) if name else DEFAULT_TENANT


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: str | Iterable[str], exempt_prefixes: tuple[str, ...] = (HEALTH_PREFIX,)) -> None:
        listed = [tokens] if isinstance(tokens, str) else list(tokens)
        self._expected = [f"Bearer {token}".encode() for token in listed]
        self._exempt = exempt_prefixes

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        method = handler_call_details.method
        if method.startswith(self._exempt):
            return await continuation(handler_call_details)
        metadata = handler_call_details.invocation_metadata
        handler = await continuation(handler_call_details)
        if sum(1 for key, _ in metadata or () if key == "authorization") > 1:
            # Which one would count is a guess the caller and a proxy in between may make
            # differently: refuse rather than take the first.
            return _refusing(
                handler, "more than one 'authorization' header; send exactly one 'authorization: Bearer <token>'"
            )
        presented = _bearer(metadata).encode()
        # Every token is compared (constant time each): the time taken says nothing of which matched.
        matched = [hmac.compare_digest(presented, expected) for expected in self._expected]
        if any(matched):
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
