"""Security: TLS, mutual TLS and the bearer token (streaming calls included, health exempt),
with certificates made here for 127.0.0.1/localhost; and prompts stay out of the logs unless
--log-prompts asks for them. The client library (Client, AsyncClient) and the CLI's TLS
flags are used against the same servers, with right and wrong credentials."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import pytest
import tokenwire
from grpc_health.v1 import health_pb2, health_pb2_grpc
from production_support import SERVING, Pki, generation_stub, short_request, wait_until
from servers import READINESS, ServerProcess
from tokenwire.v1 import generation_pb2 as pb

pytestmark = pytest.mark.timeout(90)

TOKEN = "s3cret-" + uuid.uuid4().hex


class SecureServerProcess(ServerProcess):
    """A server that only speaks TLS: its readiness is probed over TLS too."""

    def __init__(self, args: Sequence[str], credentials: grpc.ChannelCredentials) -> None:
        self.credentials = credentials
        super().__init__(args)

    def health(
        self, service: str = READINESS, timeout: float = 2.0, credentials: grpc.ChannelCredentials | None = None
    ) -> int:
        return super().health(service, timeout, credentials or self.credentials)

    def stub(self, credentials: grpc.ChannelCredentials | None = None) -> object:
        return generation_stub(self.target, credentials or self.credentials)


@pytest.fixture(scope="module")
def tls_server(tiny_model_dir: Path, pki: Pki) -> Iterator[SecureServerProcess]:
    args = ["--model", str(tiny_model_dir), "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)]
    with SecureServerProcess(args, pki.channel_credentials()) as server:
        yield server


@pytest.fixture(scope="module")
def mtls_token_server(
    tiny_model_dir: Path, pki: Pki, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SecureServerProcess]:
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN + "\n")
    args = [
        "--model", str(tiny_model_dir),
        "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--tls-client-ca", str(pki.ca_cert),
        "--auth-token-file", str(token_file),
    ]  # fmt: skip
    with SecureServerProcess(args, pki.channel_credentials(client=True)) as server:
        yield server


def generate(stub: object, metadata: Sequence[tuple[str, str]] = ()) -> list[pb.TokenChunk]:
    return list(stub.Generate(short_request(), timeout=10, metadata=metadata))  # type: ignore[attr-defined]


AUTH = (("authorization", f"Bearer {TOKEN}"),)


def test_tls_serves_over_tls_only(tls_server: SecureServerProcess) -> None:
    assert generate(tls_server.stub())[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
    with pytest.raises(grpc.RpcError) as plaintext:
        generate(generation_stub(tls_server.target))
    assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE
    assert tls_server.find("listening")[0]["tls"] is True


def test_tls_is_refused_by_a_client_that_trusts_another_ca(tls_server: SecureServerProcess, pki: Pki) -> None:
    stranger_trust = grpc.ssl_channel_credentials(pki.other_ca_cert.read_bytes())
    with pytest.raises(grpc.RpcError) as caught:
        generate(generation_stub(tls_server.target, stranger_trust))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mtls_requires_a_client_certificate_from_the_ca(mtls_token_server: SecureServerProcess, pki: Pki) -> None:
    assert generate(mtls_token_server.stub(), AUTH)[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
    for credentials in (pki.channel_credentials(), pki.channel_credentials(other_client=True)):
        with pytest.raises(grpc.RpcError) as caught:
            generate(mtls_token_server.stub(credentials), AUTH)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert mtls_token_server.find("listening")[0]["mtls"] is True


@pytest.mark.parametrize(
    "metadata",
    [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),), (("authorization", f"bearer  {TOKEN}x"),)],
    ids=["none", "wrong", "no-scheme", "mangled"],
)
def test_bearer_token_guards_every_rpc_including_the_stream(
    metadata: tuple[tuple[str, str], ...], mtls_token_server: SecureServerProcess
) -> None:
    stub = mtls_token_server.stub()
    calls = {
        "Generate": lambda: generate(stub, metadata),
        "Tokenize": lambda: stub.Tokenize(pb.TokenizeRequest(text="hi"), timeout=10, metadata=metadata),  # type: ignore[attr-defined]
        "GetModelInfo": lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10, metadata=metadata),  # type: ignore[attr-defined]
    }
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as caught:
            call()
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
    assert stub.Tokenize(pb.TokenizeRequest(text="hi"), timeout=10, metadata=AUTH).count > 0  # type: ignore[attr-defined]


def test_health_is_exempt_from_the_token(mtls_token_server: SecureServerProcess) -> None:
    channel = grpc.secure_channel(mtls_token_server.target, mtls_token_server.credentials)
    with channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", READINESS):
            assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == SERVING


@pytest.mark.parametrize("log_prompts", [False, True], ids=["default", "log-prompts"])
def test_prompts_and_outputs_are_logged_only_when_asked(log_prompts: bool, tiny_model_dir: Path) -> None:
    marker = "zebra-" + uuid.uuid4().hex[:12]
    args = ["--model", str(tiny_model_dir)] + (["--log-prompts"] if log_prompts else [])
    with ServerProcess(args) as server:
        stub = generation_stub(server.target)
        request_id = "req-" + uuid.uuid4().hex[:8]
        chunks = list(
            stub.Generate(
                pb.GenerateRequest(
                    request_id=request_id, prompt=f"say {marker} twice", stopping=pb.StoppingCriteria(max_new_tokens=6)
                ),
                timeout=30,
            )
        )
        output = "".join(c.text for c in chunks)
        chat = pb.Chat(messages=[pb.ChatMessage(role="user", content=marker)])
        list(stub.Generate(pb.GenerateRequest(chat=chat, stopping=pb.StoppingCriteria(max_new_tokens=6)), timeout=30))
        with pytest.raises(grpc.RpcError):  # a refused one is not logged with its prompt either
            list(
                stub.Generate(
                    pb.GenerateRequest(prompt=marker, stopping=pb.StoppingCriteria(max_new_tokens=0)), timeout=10
                )
            )
        assert wait_until(lambda: len(server.find("request finished")) >= 3, 15)
    logged = "\n".join(server.lines)
    finished = [r for r in server.find("request finished") if r.get("request_id") == request_id]
    assert len(finished) == 1
    if log_prompts:
        assert marker in finished[0]["prompt"]
        assert finished[0]["output"] == output
        assert logged.count(marker) >= 3
    else:
        assert marker not in logged
        assert "prompt" not in finished[0] and "output" not in finished[0]


# -- the client library and the CLI against the same servers ----------------------------------

TOKENWIRE = shutil.which("tokenwire", path=str(Path(sys.executable).parent)) or shutil.which("tokenwire")


def tls(pki: Pki, *, client: bool = False, ca: Path | None = None) -> tokenwire.TLSConfig:
    return tokenwire.TLSConfig(
        root_certificates=ca or pki.ca_cert,
        client_cert=pki.client_cert if client else None,
        client_key=pki.client_key if client else None,
    )


def test_client_and_async_client_over_tls(tls_server: SecureServerProcess, pki: Pki) -> None:
    with tokenwire.Client(tls_server.target, tls=tls(pki), timeout=30) as client:
        assert client.generate_text("hello", max_new_tokens=3, ignore_eos=True).usage.completion_tokens == 3
        assert client.model_info().engine == "batched"
        assert client.health() is tokenwire.HealthStatus.SERVING

    async def main() -> int:
        async with tokenwire.AsyncClient(tls_server.target, tls=tls(pki), timeout=30) as aclient:
            return (await aclient.generate_text("hello", max_new_tokens=2, ignore_eos=True)).usage.completion_tokens

    assert asyncio.run(main()) == 2


def test_a_client_that_trusts_another_ca_cannot_connect(tls_server: SecureServerProcess, pki: Pki) -> None:
    with tokenwire.Client(
        tls_server.target, tls=tls(pki, ca=pki.other_ca_cert), timeout=5, retry=tokenwire.NO_RETRY
    ) as c:
        with pytest.raises(tokenwire.Unavailable):
            c.generate_text("hello", max_new_tokens=2)
    with tokenwire.Client(tls_server.target, timeout=5, retry=tokenwire.NO_RETRY) as plaintext:
        with pytest.raises(tokenwire.Unavailable):
            plaintext.model_info()


def test_mutual_tls_and_token(mtls_token_server: SecureServerProcess, pki: Pki) -> None:
    target = mtls_token_server.target
    with tokenwire.Client(target, tls=tls(pki, client=True), token=TOKEN, timeout=30) as client:
        assert client.generate_text("hello", max_new_tokens=2, ignore_eos=True).usage.completion_tokens == 2
        assert client.tokenize("hello").count >= 1
    with tokenwire.Client(target, tls=tls(pki, client=True), token="wrong", timeout=10) as wrong:
        with pytest.raises(tokenwire.Unauthenticated):
            wrong.generate_text("hello", max_new_tokens=2)
        with pytest.raises(tokenwire.Unauthenticated):
            wrong.model_info()
        assert wrong.health() is tokenwire.HealthStatus.SERVING  # probes need no token
    with tokenwire.Client(target, tls=tls(pki, client=True), timeout=10) as tokenless:
        with pytest.raises(tokenwire.Unauthenticated):
            tokenless.generate_text("hello", max_new_tokens=2)
    with tokenwire.Client(target, tls=tls(pki), token=TOKEN, timeout=5, retry=tokenwire.NO_RETRY) as no_cert:
        with pytest.raises(tokenwire.Unavailable):  # the handshake fails without a client certificate
            no_cert.generate_text("hello", max_new_tokens=2)

    async def wrong_async() -> None:
        async with tokenwire.AsyncClient(target, tls=tls(pki, client=True), token="wrong", timeout=10) as aclient:
            await aclient.generate_text("hello", max_new_tokens=2)

    with pytest.raises(tokenwire.Unauthenticated):
        asyncio.run(wrong_async())


def test_the_cli_flags_reach_a_mutual_tls_server(
    mtls_token_server: SecureServerProcess, pki: Pki, tmp_path: Path
) -> None:
    assert TOKENWIRE
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    wrong_file = tmp_path / "wrong"
    wrong_file.write_text("wrong")
    base = [TOKENWIRE, "generate", "--target", mtls_token_server.target, "--ca-file", str(pki.ca_cert),
            "--cert-file", str(pki.client_cert), "--key-file", str(pki.client_key),
            "--max-new-tokens", "3", "--ignore-eos"]  # fmt: skip

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*base, *extra, "hello"], capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"}
        )

    ok = run("--token-file", str(token_file))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip()
    refused = run("--token-file", str(wrong_file))
    assert refused.returncode == 7, refused.stderr  # UNAUTHENTICATED
    health = subprocess.run(
        [TOKENWIRE, "health", "--target", mtls_token_server.target, "--ca-file", str(pki.ca_cert),
         "--cert-file", str(pki.client_cert), "--key-file", str(pki.client_key)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert health.returncode == 0 and "SERVING" in health.stdout
