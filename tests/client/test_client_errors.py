"""The pieces under the client: status -> exception, retry delays, targets and TLS."""

from __future__ import annotations

import random

import grpc
import pytest
import tokenwire
from fakes import FakeRpcError
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from tokenwire.channel import TLSConfig, credentials, resolve_target
from tokenwire.errors import error_class, from_rpc_error
from tokenwire.retry import RetryPolicy


def _status_trailer(code, message, *details):
    status = status_pb2.Status(code=code, message=message)
    for detail in details:
        packed = any_pb2.Any()
        packed.Pack(detail)
        status.details.append(packed)
    return ("grpc-status-details-bin", status.SerializeToString())


def test_bad_request_violations_are_parsed():
    bad = error_details_pb2.BadRequest()
    bad.field_violations.add(field="sampling.top_p", description="must be in (0, 1], got 2.0")
    bad.field_violations.add(field="prompt", description="must not be empty")
    error = from_rpc_error(
        FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "bad", [_status_trailer(code_pb2.INVALID_ARGUMENT, "bad", bad)]),
        request_id="r1",
    )
    assert isinstance(error, tokenwire.InvalidArgument)
    assert [str(v) for v in error.field_violations] == [
        "sampling.top_p: must be in (0, 1], got 2.0",
        "prompt: must not be empty",
    ]
    assert error.request_id == "r1" and error.details == "bad"
    assert str(error) == "INVALID_ARGUMENT: bad (request_id=r1)"


def test_retry_info_and_pushback_trailer():
    info = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=1, nanos=500_000_000))
    trailer = _status_trailer(code_pb2.RESOURCE_EXHAUSTED, "full", info)
    error = from_rpc_error(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", [trailer]))
    assert isinstance(error, tokenwire.Overloaded) and error.retry_after == pytest.approx(1.5)
    error = from_rpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "draining", [("grpc-retry-pushback-ms", "750")]))
    assert isinstance(error, tokenwire.Unavailable) and error.retry_after == pytest.approx(0.75)


def test_request_id_trailer_and_malformed_details():
    error = from_rpc_error(
        FakeRpcError(
            grpc.StatusCode.INTERNAL,
            "boom",
            [("x-request-id", "srv-7"), ("grpc-status-details-bin", b"\xff\x00garbage")],
        ),
        request_id="mine",
    )
    assert isinstance(error, tokenwire.Internal) and error.request_id == "srv-7"


def test_bare_rpc_error_is_unknown():
    error = from_rpc_error(grpc.RpcError("odd"))
    assert isinstance(error, tokenwire.Unknown)


def test_every_status_code_has_a_class():
    for code in grpc.StatusCode:
        if code is grpc.StatusCode.OK:
            continue
        cls = error_class(code)
        assert issubclass(cls, tokenwire.TokenwireError) and cls is not tokenwire.TokenwireError, code
        assert cls.code == code


def test_backoff_grows_with_jitter_and_is_bounded():
    policy = RetryPolicy(max_attempts=6, initial_backoff=0.1, max_backoff=0.5, multiplier=2, jitter=0.2)
    rng = random.Random(1)
    overloaded = tokenwire.Overloaded("full")
    delays = [policy.backoff(n, overloaded, rng) for n in range(1, 6)]
    for delay, base in zip(delays, [0.1, 0.2, 0.4, 0.5, 0.5], strict=True):
        assert delay is not None and base * 0.8 <= delay <= base * 1.2
    assert policy.backoff(6, overloaded, rng) is None  # attempts used up


def test_backoff_follows_the_server_and_only_for_retryable_codes():
    policy = RetryPolicy(jitter=0.1)
    told = tokenwire.Overloaded("full", retry_after=2.0)
    assert 2.0 <= policy.backoff(1, told) <= 2.2
    assert policy.backoff(1, tokenwire.Overloaded("no", retry_after=-1)) is None
    assert policy.backoff(1, tokenwire.Unavailable("gone")) is not None
    for error in (tokenwire.Internal("x"), tokenwire.InvalidArgument("x"), tokenwire.DeadlineExceeded("x")):
        assert policy.backoff(1, error) is None
    assert tokenwire.NO_RETRY.backoff(1, tokenwire.Unavailable("x")) is None
    # CANCELLED: not retried when this side cancelled (the default), retried when the server did
    assert policy.backoff(1, tokenwire.Cancelled("x")) is None
    assert policy.backoff(1, tokenwire.Cancelled("x"), cancelled_here=False) is not None
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)


def test_targets():
    assert resolve_target("localhost:50051") == "localhost:50051"
    assert resolve_target("dns:///tokenwire.default.svc:50051") == "dns:///tokenwire.default.svc:50051"
    assert resolve_target(["127.0.0.1:5001", "127.0.0.1:5002"]) == "ipv4:127.0.0.1:5001,127.0.0.1:5002"
    assert resolve_target(["[::1]:5001"]) == "ipv6:[::1]:5001"
    assert resolve_target(["localhost:5003"]).endswith(":5003")
    with pytest.raises(ValueError):
        resolve_target([])
    with pytest.raises(ValueError):
        resolve_target(["no-port"])


def test_tls_config(tmp_path):
    assert credentials(False) is None
    assert credentials(True) is not None
    with pytest.raises(ValueError):
        TLSConfig(client_cert=b"x")
    pem = tmp_path / "ca.pem"
    pem.write_bytes(b"-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n")
    assert credentials(TLSConfig(root_certificates=pem)) is not None
    assert credentials(TLSConfig(root_certificates=str(pem))) is not None
    with pytest.raises(FileNotFoundError):
        credentials(TLSConfig(root_certificates=tmp_path / "missing.pem"))


def test_tls_client_against_plaintext_server_is_unavailable(fake):
    with tokenwire.Client(fake.address, tls=True, retry=tokenwire.NO_RETRY, timeout=5) as client:
        with pytest.raises(tokenwire.Unavailable):
            client.generate_text("x")
