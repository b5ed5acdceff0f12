"""How the client reaches the server: target strings, TLS, auth and trace metadata, load balancing.

Every channel uses the ``round_robin`` policy, so a ``dns:///`` name that resolves to
several replicas (a Kubernetes headless Service) or a list of addresses spreads
calls over all of them, and a retried call goes to the next replica.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc

__all__ = [
    "ChannelOptions",
    "PemSource",
    "TLSConfig",
    "channel_options",
    "credentials",
    "resolve_target",
    "trace_metadata",
]

PemSource = bytes | str | Path
ChannelOptions = list[tuple[str, str | int]]

_SERVICE_CONFIG = json.dumps(
    {
        "loadBalancingConfig": [{"round_robin": {}}],
    }
)


@dataclasses.dataclass(frozen=True)
class TLSConfig:
    """TLS settings. Each PEM is bytes (the PEM itself), or a str/Path naming a file;
    a str that starts with ``-----BEGIN`` is taken as the PEM text.

    ``root_certificates`` None: the system's trust store. ``client_cert`` and
    ``client_key`` together: mutual TLS. ``server_name``: the name to verify the
    server's certificate against, when it differs from the target's host.
    """

    root_certificates: PemSource | None = None
    client_cert: PemSource | None = None
    client_key: PemSource | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("client_cert and client_key go together")


def _pem(source: PemSource | None) -> bytes | None:
    if source is None or isinstance(source, bytes):
        return source
    if isinstance(source, str) and source.lstrip().startswith("-----BEGIN"):
        return source.encode()
    return Path(source).read_bytes()


def credentials(tls: bool | TLSConfig) -> grpc.ChannelCredentials | None:
    """Channel credentials for ``tls`` (None: a plaintext channel)."""
    if tls is False:
        return None
    config = TLSConfig() if tls is True else tls
    return grpc.ssl_channel_credentials(
        root_certificates=_pem(config.root_certificates),
        private_key=_pem(config.client_key),
        certificate_chain=_pem(config.client_cert),
    )


def _split_host_port(address: str) -> tuple[str, str]:
    if address.startswith("["):  # [::1]:5001
        host, _, port = address[1:].partition("]:")
        return host, port
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} must be host:port")
    return host, port


def _ip_literals(host: str, port: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    seen: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    for info in infos:
        ip = ipaddress.ip_address(info[4][0])
        if ip not in seen:
            seen.append(ip)
    return seen


def resolve_target(target: str | Sequence[str]) -> str:
    """A gRPC target for one target string or a list of ``host:port`` addresses.

    A string is used as is (``localhost:50051``, ``dns:///svc:50051``, ``ipv4:...``).
    A list becomes one multi-address ``ipv4:`` (or ``ipv6:``) target; host names in it
    are resolved once, here.
    """
    if isinstance(target, str):
        return target
    addresses = list(target)
    if not addresses:
        raise ValueError("the list of addresses is empty")
    v4: list[str] = []
    v6: list[str] = []
    for address in addresses:
        host, port = _split_host_port(address)
        for ip in _ip_literals(host, port):
            if ip.version == 4:
                v4.append(f"{ip}:{port}")
            else:
                v6.append(f"[{ip}]:{port}")
    # One target holds one address family; IPv4 wins when a name resolves to both.
    if v4:
        return "ipv4:" + ",".join(v4)
    return "ipv6:" + ",".join(v6)


def channel_options(*, tls: bool | TLSConfig = False, extra: Sequence[tuple[str, str | int]] = ()) -> ChannelOptions:
    options: ChannelOptions = [
        ("grpc.lb_policy_name", "round_robin"),
        ("grpc.service_config", _SERVICE_CONFIG),
        # Keep long streams alive through idle proxies and notice dead peers.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
    ]
    if isinstance(tls, TLSConfig) and tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    options.extend(extra)
    return options


def trace_metadata(metadata: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """``metadata`` plus the caller's current OpenTelemetry context (W3C ``traceparent`` and
    ``tracestate``, ``baggage``: whatever the configured propagators write), so the server's
    span joins the caller's trace.

    OpenTelemetry is optional: without it, or in a process that never imported it (and so
    cannot have a span to propagate), this is ``metadata`` as it is, at no cost. A key the
    caller set itself in ``metadata`` is left as the caller set it.
    """
    if "opentelemetry" not in sys.modules:
        return metadata
    try:
        from opentelemetry import propagate
    except ImportError:
        return metadata
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    present = {key for key, _ in metadata}
    extra = tuple((key.lower(), value) for key, value in carrier.items() if key.lower() not in present)
    return (*metadata, *extra) if extra else metadata
