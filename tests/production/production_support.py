"""Helpers for the production-behaviour tests: stubs, long requests, test certificates,
and a server run in this process (for fault injection into its model). The fixtures
themselves are registered in conftest.py."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families
from servers import health_check
from tokenwire.v1 import generation_pb2 as pb
from tokenwire.v1 import generation_pb2_grpc as pb_grpc
from tokenwire_server.config import ServerConfig
from tokenwire_server.health import LIVENESS_SERVICE as LIVENESS
from tokenwire_server.health import NOT_SERVING, SERVING
from tokenwire_server.health import READINESS_SERVICE as READINESS
from tokenwire_server.server import TokenwireServer

# The health room's names, re-exported for the tests here.
__all__ = ["LIVENESS", "NOT_SERVING", "READINESS", "SERVING"]


def generation_stub(target: str, credentials: grpc.ChannelCredentials | None = None) -> pb_grpc.TextGenerationStub:
    channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    return pb_grpc.TextGenerationStub(channel)


def health_status(target: str, service: str = READINESS, timeout: float = 2.0) -> int:
    return health_check(target, service, timeout)


def long_request(tokens: int = 1000, **fields: Any) -> pb.GenerateRequest:
    """A request that keeps its slot busy for a while (``tokens`` decode steps of the tiny model)."""
    return pb.GenerateRequest(
        prompt="hello", stopping=pb.StoppingCriteria(max_new_tokens=tokens, ignore_eos=True), **fields
    )


def short_request(tokens: int = 4, **fields: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="hello", stopping=pb.StoppingCriteria(max_new_tokens=tokens), **fields)


class Samples(dict):
    """A scrape: every sample by (name, sorted labels), and the metric families the server
    declares (a labelled family no call has moved yet has no sample, only its HELP/TYPE)."""

    def __init__(self, text: str) -> None:
        families = list(text_string_to_metric_families(text))
        super().__init__(
            ((s.name, tuple(sorted(s.labels.items()))), s.value) for family in families for s in family.samples
        )
        self.families = {family.name for family in families}


def scrape(server: Any) -> Samples:
    """Every sample of a server's /metrics (its --metrics-port), by name and sorted labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5) as response:
        return Samples(response.read().decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    """A sample's value, 0.0 where a declared counter has no sample with these labels yet (no
    call moved it); ``sample`` where absence itself must fail. A metric the server does not
    declare, or labels other than the ones its samples carry, fail here: a misspelt or removed
    metric must not read as zero."""
    key = (name, tuple(sorted(labels.items())))
    if key in samples:
        return float(samples[key])
    declared = {f for f in samples.families if name == f or name.startswith(f + "_")}
    assert declared, f"the server declares no metric {name}"
    label_sets = {frozenset(k for k, _ in labelled) for n, labelled in samples if n == name}
    assert not label_sets or label_sets == {frozenset(labels)}, f"{name} is labelled {label_sets}, not {set(labels)}"
    return 0.0


def sample(samples: Samples, name: str, **labels: str) -> float:
    """A sample that must be there: its value, or an AssertionError naming it."""
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"no sample {name}{labels} in the scrape"
    return float(samples[key])


def wait_until(condition: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


class InProcessServer:
    """A TokenwireServer on its own asyncio loop in a background thread, so a test can reach into
    its model and engine (fault injection) while talking to it over a real 127.0.0.1 port."""

    def __init__(self, config: ServerConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server-loop", daemon=True)
        self._thread.start()
        self.server = TokenwireServer(config)
        self.call(self.server.start())
        self.call(self.server.load(), timeout=120)
        self._watchdog = asyncio.run_coroutine_threadsafe(self.server.watchdog(), self.loop)
        self.target = f"127.0.0.1:{self.server.port}"

    def call(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def backend(self) -> Any:
        """The LocalBackend: ``.loaded`` (the model) and ``.engine``."""
        return self.server.backend

    def close(self) -> None:
        try:
            self.call(self.server.drain("test over"), timeout=30)
        finally:
            self._watchdog.cancel()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


# -- test certificates ---------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca_cert: Path  # a CA that signed nothing here
    other_client_cert: Path  # a client certificate signed by other_ca
    other_client_key: Path

    def channel_credentials(self, client: bool = False, other_client: bool = False) -> grpc.ChannelCredentials:
        if other_client:
            key, chain = self.other_client_key.read_bytes(), self.other_client_cert.read_bytes()
            return grpc.ssl_channel_credentials(self.ca_cert.read_bytes(), key, chain)
        if client:
            key, chain = self.client_key.read_bytes(), self.client_cert.read_bytes()
            return grpc.ssl_channel_credentials(self.ca_cert.read_bytes(), key, chain)
        return grpc.ssl_channel_credentials(self.ca_cert.read_bytes())


@contextlib.contextmanager
def in_process_servers(model_dir: Path) -> Iterator[Callable[..., InProcessServer]]:
    """A factory of servers in this process, ``start(engine="simple", stall_timeout=1.0)``,
    each drained at the end (for fault injection into their model)."""
    started: list[InProcessServer] = []

    def start(**overrides: Any) -> InProcessServer:
        fields: dict[str, Any] = dict(model=str(model_dir), host="127.0.0.1", port=0, grace_period=5.0)
        fields.update(overrides)
        server = InProcessServer(ServerConfig(**fields))
        started.append(server)
        if "overlap" in overrides and fields.get("engine", "batched") == "batched":
            # The flag reaches the engine: a server built without it would run the plain loop,
            # and every overlap variant that runs through it would pass on the plain loop.
            assert server.backend.engine.overlap is (overrides["overlap"] == "on"), "--overlap did not reach the engine"
        return server

    try:
        yield start
    finally:
        for server in started:
            server.close()


def make_pki(folder: Path) -> Pki:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None = None) -> None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        if key is not None:
            path.with_suffix(".key").write_bytes(
                key.private_bytes(
                    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
                )
            )

    def ca(common: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(name(common))
            .issuer_name(name(common))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )
        return cert, key

    def leaf(
        common: str, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey], server: bool
    ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(common))
            .issuer_name(issuer[0].subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
        return builder.sign(issuer[1], hashes.SHA256()), key

    root = ca("tokenwire test CA")
    other = ca("some other CA")
    server = leaf("localhost", root, server=True)
    client = leaf("tokenwire test client", root, server=False)
    stranger = leaf("stranger", other, server=False)
    write(folder / "ca.pem", root[0])
    write(folder / "other-ca.pem", other[0])
    write(folder / "server.pem", *server)
    write(folder / "client.pem", *client)
    write(folder / "stranger.pem", *stranger)
    return Pki(
        ca_cert=folder / "ca.pem",
        server_cert=folder / "server.pem",
        server_key=folder / "server.key",
        client_cert=folder / "client.pem",
        client_key=folder / "client.key",
        other_ca_cert=folder / "other-ca.pem",
        other_client_cert=folder / "stranger.pem",
        other_client_key=folder / "stranger.key",
    )
