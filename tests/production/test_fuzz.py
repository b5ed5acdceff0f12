"""Fuzz: whatever bytes arrive as a request, and whatever hostile values its fields hold, each
call ends in a deliberate status (never UNKNOWN or INTERNAL) within its deadline, with an error
message and trailers of bounded size, and the server stays SERVING and alive.

test_property.py searches well-formed GenerateRequests; this file sends what a structured
generator cannot, and what a client library would refuse to build, to one server on the tiny
model (with bearer tokens and tenants, so the interceptor and the tenant lookup see it too):

- raw bytes: Hypothesis's ``st.binary()`` as Generate, Tokenize and GetModelInfo requests, sent
  as they are (a channel's ``unary_stream``/``unary_unary`` without a serializer);
- valid requests mutated on the wire: bit flips, truncations, inserted and deleted bytes,
  duplicated fields, huge and overlong varints, wrong wire types, lengths past the end of the
  buffer, field numbers 0 and 2**29-1, at the top level or inside a nested message;
- hostile field values, one by one (``HOSTILE``) and combined by a grammar
  (``hostile_requests``): deeply nested and self-referential JSON schemas, request ids of 9 KB
  and 1 MB or with CR/LF and control characters, 9 KB chat roles, resume indexes near 2**32,
  long resumed token lists, regex bombs, grammars with very long lines or deep nesting, two
  ``authorization`` headers, a 1 MB ``x-request-id``.

The searches collect failures rather than raise them (a raise would send Hypothesis shrinking,
far past the time budget) and end by listing each failing input with its status and message.
Under CI (CI=true) every search is derandomised (tests/conftest.py), and each has a count of
examples and a wall-clock budget, so that the file runs in under a minute on two cores.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from production_support import LIVENESS, READINESS, SERVING, health_status
from servers import ServerProcess
from tokenwire.v1 import generation_pb2 as pb

# A backstop for a hung process only: each call has its own deadline and each search a budget.
pytestmark = pytest.mark.timeout(180)

ACCEPTABLE = frozenset({grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION})
REFUSED = frozenset({grpc.StatusCode.UNAUTHENTICATED})
# gRPC's own limit on a request's metadata refuses it before any handler: always past 16 KiB,
# sometimes (at random) past 8 KiB.
METADATA_SOFT_LIMIT = 8 * 1024
METADATA_TOO_LARGE = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED})
CALL_TIMEOUT_S = 10.0  # each call's deadline: the tiny model answers any request here in well under a second
HANG_SLACK_S = 2.0  # a call that outlives its deadline by more than this hangs
MAX_MESSAGE_BYTES = 4 * 1024
MAX_TRAILER_BYTES = 8 * 1024
U32 = 2**32 - 1
U64 = 2**64 - 1

SERVICE = "/tokenwire.v1.TextGeneration/"
TOKENS = {"tok-alpha": "alpha", "tok-beta": "beta"}
TENANTS = """
[tenants.alpha]
weight = 2

[tenants.beta]
weight = 1
max_priority = "normal"
"""
AUTH = (("authorization", "Bearer tok-alpha"),)


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("fuzz")
    (folder / "tokens").write_text("".join(f"{token} {tenant}\n" for token, tenant in TOKENS.items()))
    (folder / "tenants.toml").write_text(TENANTS)
    args = [
        "--model", str(tiny_model_dir), "--default-max-new-tokens", "4", "--max-new-tokens-limit", "8",
        "--auth-token-file", str(folder / "tokens"), "--tenant-config", str(folder / "tenants.toml"),
    ]  # fmt: skip
    with ServerProcess(args) as server:
        yield server


@pytest.fixture(scope="module")
def rpcs(fuzz_server: ServerProcess) -> Iterator[dict[str, Callable[..., Any]]]:
    """The three RPCs, taking raw request bytes (no serializer) and parsing what comes back."""
    with grpc.insecure_channel(fuzz_server.target) as channel:
        yield {
            "Generate": channel.unary_stream(SERVICE + "Generate", request_serializer=None,
                                             response_deserializer=pb.TokenChunk.FromString),
            "Tokenize": channel.unary_unary(SERVICE + "Tokenize", request_serializer=None,
                                            response_deserializer=pb.TokenizeResponse.FromString),
            "GetModelInfo": channel.unary_unary(SERVICE + "GetModelInfo", request_serializer=None,
                                                response_deserializer=pb.ModelInfo.FromString),
        }  # fmt: skip


# -- one call and what is checked of it ------------------------------------------------


@dataclasses.dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    trailer_bytes: int
    seconds: float
    problems: list[str]


def call(rpcs: dict[str, Callable[..., Any]], method: str, data: bytes, metadata: Sequence[tuple[str, str]] = AUTH,
         allowed: frozenset[grpc.StatusCode] = ACCEPTABLE, timeout: float = CALL_TIMEOUT_S) -> Outcome:  # fmt: skip
    """Send ``data`` as the request of ``method``; the outcome, with every rule it broke."""
    started = time.monotonic()
    problems: list[str] = []
    trailers: Sequence[tuple[str, str | bytes]] = ()
    try:
        if method == "Generate":
            stream = rpcs[method](data, metadata=metadata, timeout=timeout)
            chunks = list(stream)
            trailers = stream.trailing_metadata() or ()
            if not chunks or chunks[-1].finish_reason == pb.FINISH_REASON_UNSPECIFIED:
                problems.append(f"an OK stream of {len(chunks)} chunks without a finish reason on its last")
        else:
            _, rendezvous = rpcs[method].with_call(data, metadata=metadata, timeout=timeout)
            trailers = rendezvous.trailing_metadata() or ()
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as error:
        code, details = error.code(), error.details() or ""  # type: ignore[attr-defined]
        trailers = error.trailing_metadata() or ()  # type: ignore[attr-defined]
    seconds = time.monotonic() - started
    size = sum(len(key) + len(value) for key, value in trailers)
    if code not in allowed:
        problems.append(f"ended {code.name}, expected one of {sorted(c.name for c in allowed)}")
    if seconds > timeout + HANG_SLACK_S:
        problems.append(f"took {seconds:.1f} s against a deadline of {timeout:g} s")
    if len(details.encode()) > MAX_MESSAGE_BYTES:
        problems.append(f"a message of {len(details.encode())} bytes (at most {MAX_MESSAGE_BYTES})")
    if size > MAX_TRAILER_BYTES:
        problems.append(f"trailers of {size} bytes (at most {MAX_TRAILER_BYTES})")
    return Outcome(code, details, size, seconds, problems)


def assert_serving(server: ServerProcess) -> None:
    assert server.proc.poll() is None, "the server died:\n" + server.output()
    assert health_status(server.target, READINESS) == SERVING
    assert health_status(server.target, LIVENESS) == SERVING


class Search:
    """A bounded search's bookkeeping: statuses seen, failures kept, the time budget."""

    def __init__(self, budget_s: float) -> None:
        self.deadline = time.monotonic() + budget_s
        self.budget_s = budget_s
        self.seen: collections.Counter[str] = collections.Counter()
        self.failures: dict[str, list[str]] = {}
        self.late = 0

    def over(self) -> bool:
        if time.monotonic() > self.deadline:
            self.late += 1  # counted, not raised: the search stops sending, Hypothesis goes on drawing
            return True
        return False

    def record(self, label: str, outcome: Outcome) -> None:
        self.seen[outcome.code.name] += 1
        if outcome.problems:
            # By what went wrong and the message's first words, so that one bug is one line.
            kind = f"{'; '.join(outcome.problems)}: {outcome.details[:80]!r}"
            self.failures.setdefault(kind, []).append(label)

    def check(self, least: int) -> None:
        sent = sum(self.seen.values())
        print(f"statuses: {dict(self.seen)}; {sent} sent, {self.late} left when {self.budget_s:g} s ran out")
        failed = sum(len(labels) for labels in self.failures.values())
        assert not self.failures, f"{failed} of {sent} calls failed, in {len(self.failures)} ways:\n" + "\n".join(
            f"- {kind} ({len(labels)} calls), e.g. {labels[0][:400]}" for kind, labels in self.failures.items()
        )
        assert sent >= least, f"only {sent} calls in {self.budget_s:g} s: the server slowed down"


def shown(data: bytes, limit: int = 160) -> str:
    return data[:limit].hex() + (f"... ({len(data)} bytes)" if len(data) > limit else "")


# -- the protobuf wire format, just enough to take a message apart and put it back -------


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def read_varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            return value, at


@dataclasses.dataclass
class Field:
    """One field on the wire: its number, wire type and the bytes after its tag (for a
    length-delimited field, the length and the payload)."""

    number: int
    wire_type: int
    body: bytes

    def encode(self) -> bytes:
        return varint(self.number << 3 | self.wire_type) + self.body

    def payload(self) -> bytes | None:
        if self.wire_type != 2:
            return None
        length, start = read_varint(self.body, 0)
        return self.body[start:]


def fields_of(data: bytes) -> list[Field] | None:
    """The top-level fields of a message; None when the bytes do not parse (after a mutation)."""
    out, at = [], 0
    try:
        while at < len(data):
            tag, at = read_varint(data, at)
            number, wire_type = tag >> 3, tag & 7
            start = at
            if wire_type == 0:
                _, at = read_varint(data, at)
            elif wire_type == 1:
                at += 8
            elif wire_type == 2:
                length, at = read_varint(data, at)
                at += length
            elif wire_type == 5:
                at += 4
            else:
                return None  # groups and wire types 6, 7: nothing a tokenwire message holds
            if at > len(data):
                return None
            out.append(Field(number, wire_type, data[start:at]))
    except ValueError:
        return None
    return out


def encoded(fields: Sequence[Field]) -> bytes:
    return b"".join(f.encode() for f in fields)


# -- mutations of a serialized message -----------------------------------------------

# Varint bodies past what a field holds: uint64 max, 2**63 (a negative int64), just past uint32,
# an 11-byte varint (overlong), a 10-byte one with bits past 64, and one that never ends.
HUGE_VARINTS = (
    varint(U64), varint(2**63), varint(2**32), varint(U32), varint(2**31),
    b"\xff" * 10 + b"\x01", b"\x80" * 9 + b"\x7f", b"\xff\xff\xff",
)  # fmt: skip
BAD_LENGTHS = (1, 7, 1000, 2**31 - 1, 2**32, U64)  # added to (or set as) a payload's length
FIELD_NUMBERS = (0, 15, 16, 19000, 2**29 - 1, 2**32)  # 0 and 19000..19999 are reserved; 2**32 is past a tag


def mutation(draw: st.DrawFn, data: bytes, depth: int = 0) -> bytes:
    """One mutation of ``data``, byte-wise or field-wise (a field-wise one falls back to a bit
    flip when the bytes no longer parse)."""
    kind = draw(st.sampled_from(MUTATIONS))
    fields = fields_of(data)
    if kind in FIELD_WISE and not fields:
        kind = "flip"
    if kind == "flip":
        if not data:
            return b"\x00"
        bit = draw(st.integers(0, len(data) * 8 - 1))
        out = bytearray(data)
        out[bit // 8] ^= 1 << (bit % 8)
        return bytes(out)
    if kind == "truncate":
        return data[: draw(st.integers(0, max(0, len(data) - 1)))]
    if kind == "insert":
        at = draw(st.integers(0, len(data)))
        return data[:at] + draw(st.binary(min_size=1, max_size=16)) + data[at:]
    if kind == "delete":
        at = draw(st.integers(0, len(data)))
        return data[:at] + data[at + draw(st.integers(1, 16)) :]
    if kind == "splice":  # another request's bytes: proto merges them (last oneof wins, lists append)
        other = draw(st.sampled_from(SEEDS)).SerializeToString()
        return data + other if draw(st.booleans()) else other + data
    assert fields
    i = draw(st.integers(0, len(fields) - 1))
    field = fields[i]
    if kind == "duplicate":
        fields.insert(draw(st.integers(0, len(fields))), field)
        if draw(st.booleans()):  # many copies of it: a repeated field grows, a scalar's last wins
            fields.extend([field] * draw(st.integers(2, 200)))
    elif kind == "huge_varint":
        fields[i] = Field(field.number, 0, draw(st.sampled_from(HUGE_VARINTS)))
    elif kind == "wire_type":
        fields[i] = Field(
            field.number, draw(st.sampled_from([t for t in range(8) if t != field.wire_type])), field.body
        )
    elif kind == "number":
        fields[i] = Field(draw(st.sampled_from(FIELD_NUMBERS)), field.wire_type, field.body)
    elif kind == "length":
        payload = field.payload()
        if payload is None:
            fields[i] = Field(field.number, 2, varint(draw(st.sampled_from(BAD_LENGTHS))) + field.body)
        else:
            bad = draw(st.sampled_from(BAD_LENGTHS))
            length = bad if bad > 2**30 else len(payload) + bad
            fields[i] = Field(field.number, 2, varint(length) + payload)
    elif kind == "nested":
        payload = field.payload()
        if payload is None or depth >= 3:
            return mutation(draw, data, depth + 1) if depth < 3 else data
        inner = mutation(draw, payload, depth + 1)
        fields[i] = Field(field.number, 2, varint(len(inner)) + inner)
    return encoded(fields)


FIELD_WISE = ("duplicate", "huge_varint", "wire_type", "number", "length", "nested")
MUTATIONS = ("flip", "truncate", "insert", "delete", "splice", *FIELD_WISE, "nested", "nested")

# Valid requests that between them set every field of GenerateRequest, each small enough that
# a mutation which stays valid is answered in milliseconds.
_SMALL = pb.StoppingCriteria(max_new_tokens=4)
SEEDS = (
    pb.GenerateRequest(
        request_id="fuzz-1",
        prompt="Once upon a time",
        sampling=pb.SamplingParams(temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.1, seed=7),
        stopping=pb.StoppingCriteria(
            max_new_tokens=4,
            min_new_tokens=1,
            stop_sequences=["\n", "end"],
            include_stop_sequence=True,
            ignore_eos=True,
            time_limit_ms=5000,
        ),  # fmt: skip
        output=pb.OutputOptions(token_ids=True, logprobs=True, top_logprobs=2),
        priority=pb.PRIORITY_LOW,
    ),
    pb.GenerateRequest(
        chat=pb.Chat(
            messages=[pb.ChatMessage(role="system", content="Be brief."), pb.ChatMessage(role="user", content="Hi")]
        ),
        stopping=_SMALL,
    ),
    pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[1, 2, 3, 4000, 49151]), stopping=_SMALL, output=pb.OutputOptions(token_ids=True)
    ),
    pb.GenerateRequest(
        prompt="JSON:",
        stopping=_SMALL,
        response_format=pb.ResponseFormat(
            json_schema='{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}'
        ),
    ),
    pb.GenerateRequest(prompt="JSON:", stopping=_SMALL, response_format=pb.ResponseFormat(json_object=True)),
    pb.GenerateRequest(prompt="Date:", stopping=_SMALL, response_format=pb.ResponseFormat(regex=r"\d{4}-\d{2}-\d{2}")),
    pb.GenerateRequest(
        prompt="Pick:", stopping=_SMALL, response_format=pb.ResponseFormat(choice=pb.Choice(options=["yes", "no"]))
    ),
    pb.GenerateRequest(
        prompt="Say:", stopping=_SMALL, response_format=pb.ResponseFormat(grammar='root ::= "a" | "b" "c"')
    ),
    pb.GenerateRequest(
        prompt="hello",
        sampling=pb.SamplingParams(temperature=1.0, seed=3),
        stopping=pb.StoppingCriteria(max_new_tokens=6),
        output=pb.OutputOptions(token_ids=True),
        resume=pb.Resume(generated_token_ids=[28, 29], next_index=2),
    ),
)
TOKENIZE_SEEDS = (
    pb.TokenizeRequest(text="Hello, world", return_tokens=True, return_offsets=True),
    pb.TokenizeRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="Hi")]), return_tokens=True),
)


@st.composite
def mutated(draw: st.DrawFn, seeds: Sequence[Any] = SEEDS) -> bytes:
    data = draw(st.sampled_from(seeds)).SerializeToString()
    for _ in range(draw(st.integers(1, 4))):
        data = mutation(draw, data)
    return data


raw_bytes = st.binary(max_size=512)
FUZZ_SETTINGS = dict(
    deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


def raw_search(rpcs: dict[str, Callable[..., Any]], method: str, requests: st.SearchStrategy[bytes],
               examples: int, budget_s: float) -> Search:  # fmt: skip
    search = Search(budget_s)

    @settings(max_examples=examples, **FUZZ_SETTINGS)  # type: ignore[arg-type]
    @given(data=requests)
    def send(data: bytes) -> None:
        if not search.over():
            search.record(f"{method} {shown(data)}", call(rpcs, method, data))

    send()
    return search


def test_raw_and_mutated_generate_requests_end_in_a_deliberate_status(fuzz_server: ServerProcess, rpcs: dict) -> None:
    assert call(rpcs, "GetModelInfo", b"").code == grpc.StatusCode.OK  # the token works: a refusal below is a finding
    search = raw_search(rpcs, "Generate", raw_bytes | mutated(), examples=500, budget_s=10)
    search.check(least=150)
    assert search.seen["OK"] and search.seen["INVALID_ARGUMENT"]  # some mutations stay valid, most do not
    assert_serving(fuzz_server)


def test_raw_and_mutated_tokenize_and_model_info_requests_end_in_a_deliberate_status(
    fuzz_server: ServerProcess, rpcs: dict
) -> None:
    tokenize = raw_search(rpcs, "Tokenize", raw_bytes | mutated(TOKENIZE_SEEDS) | mutated(), examples=250, budget_s=5)
    info = raw_search(rpcs, "GetModelInfo", raw_bytes | mutated(), examples=150, budget_s=3)
    tokenize.check(least=80)
    info.check(least=50)
    assert tokenize.seen["OK"] and tokenize.seen["INVALID_ARGUMENT"]
    assert_serving(fuzz_server)


# -- hostile field values ------------------------------------------------------------


def nested_objects(depth: int) -> str:
    return '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth


def nested_arrays(depth: int) -> str:
    return '{"type":"array","items":' * depth + '{"type":"integer"}' + "}" * depth


def formatted(**fmt: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="hi", stopping=_SMALL, response_format=pb.ResponseFormat(**fmt))


def resumed(ids: Sequence[int], next_index: int, tokens: int = 8) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt="hi",
        stopping=pb.StoppingCriteria(max_new_tokens=tokens, ignore_eos=True),
        output=pb.OutputOptions(token_ids=True),
        resume=pb.Resume(generated_token_ids=ids, next_index=next_index),
    )


def bearer(*tokens: str) -> tuple[tuple[str, str], ...]:
    return tuple(("authorization", f"Bearer {token}") for token in tokens)


@dataclasses.dataclass(frozen=True)
class Hostile:
    name: str
    request: pb.GenerateRequest
    metadata: tuple[tuple[str, str], ...] = AUTH
    allowed: frozenset[grpc.StatusCode] = ACCEPTABLE

    def __repr__(self) -> str:  # a failure's report shows the name, not a megabyte of request
        return f"Hostile({self.name!r})"


def _chat(role: str, content: str = "hi") -> pb.GenerateRequest:
    return pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role=role, content=content)]), stopping=_SMALL)


_HI = pb.GenerateRequest(prompt="hi", stopping=_SMALL)
HOSTILE = (
    # JSON schemas nested past any recursion limit, or that refer to themselves
    Hostile("json_schema objects nested 500 deep", formatted(json_schema=nested_objects(500))),
    Hostile("json_schema objects nested 1700 deep", formatted(json_schema=nested_objects(1700))),
    Hostile("json_schema arrays nested 2500 deep", formatted(json_schema=nested_arrays(2500))),
    Hostile("json_schema of 30000 '['", formatted(json_schema="[" * 30000)),
    Hostile("json_schema of 12000 '{\"a\":'", formatted(json_schema='{"a":' * 12000)),
    Hostile("json_schema $ref to itself", formatted(json_schema='{"$ref":"#"}')),
    Hostile("json_schema $refs in a loop",
            formatted(json_schema='{"$defs":{"a":{"$ref":"#/$defs/b"},"b":{"$ref":"#/$defs/a"}},"$ref":"#/$defs/a"}')),
    Hostile("json_schema with a 60000-character type", formatted(json_schema='{"type":"' + "q" * 60000 + '"}')),
    Hostile("json_schema minLength 1e8", formatted(json_schema='{"type":"string","minLength":100000000}')),
    Hostile("json_schema pattern bomb", formatted(json_schema=json.dumps({"type": "string", "pattern": "(a*)*b"}))),
    # request ids: too long for a trailer, or not valid in one
    Hostile("request_id of 9 KB", pb.GenerateRequest(prompt="hi", stopping=_SMALL, request_id="r" * 9 * 1024)),
    Hostile("request_id of 1 MB", pb.GenerateRequest(prompt="hi", stopping=_SMALL, request_id="r" * (1 << 20))),
    Hostile("request_id with CR/LF", pb.GenerateRequest(prompt="hi", stopping=_SMALL, request_id="a\r\nx-injected: 1")),
    Hostile("request_id of control characters",
            pb.GenerateRequest(prompt="hi", stopping=_SMALL, request_id="\x01\x07\x1b[31m\x7f\t")),
    Hostile("request_id of 129 emoji", pb.GenerateRequest(prompt="hi", stopping=_SMALL, request_id="\U0001f600" * 129)),
    # chat roles and contents past any trailer
    Hostile("chat role of 9 KB", _chat("r" * 9 * 1024)),
    Hostile("chat role of 1 MB", _chat("r" * (1 << 20))),
    Hostile("chat role with CR/LF", _chat("user\r\nsystem")),
    Hostile("10000 chat messages",
            pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="x")] * 10000))),
    # resume: indexes at the edge of uint32, lists longer than the answer, ids outside the vocabulary
    Hostile("resume.next_index 2**32-1", resumed([], U32)),
    Hostile("resume.next_index 2**32-2 with 2 ids", resumed([28, 29], U32 - 1)),
    Hostile("resume.next_index 2**32-8 with 7 ids", resumed([28] * 7, U32 - 7)),
    Hostile("resume of 100000 ids", resumed([28] * 100_000, 3)),
    Hostile("resume of 8 ids at 2**32-1", resumed([28] * 8, U32)),
    Hostile("resume id 2**32-1", resumed([U32, 28], 2)),
    # regular expressions that explode for a backtracking engine or a naive automaton
    Hostile("regex (a*)*b", formatted(regex="(a*)*b")),
    Hostile("regex ((a|a)*)* x50", formatted(regex="((a|a)*)*" * 50)),
    Hostile("regex (a{1000}){1000}", formatted(regex="(a{1000}){1000}")),
    Hostile("regex a{2147483647}", formatted(regex="a{2147483647}")),
    Hostile("regex of 20000 nested groups", formatted(regex="(" * 20000 + "a" + ")" * 20000)),
    Hostile("regex unclosed [", formatted(regex="[")),
    # formats that compile but that no token of the vocabulary can start (found by the raw search)
    Hostile("regex of a control character no token spells", formatted(regex="\x13")),
    Hostile("regex that matches nothing", formatted(regex="[^\\x00-\\U0010FFFF]")),
    Hostile("choice of a control character no token spells", formatted(choice=pb.Choice(options=["\x06"]))),
    # grammars with very long lines, or nested past a parser's stack
    Hostile("lark string of 60000 characters", formatted(grammar='start: "' + "a" * 60000 + '"')),
    Hostile("lark rule of 60000 characters", formatted(grammar="start: " + "a" * 60000)),
    Hostile("lark line of 30000 '%'", formatted(grammar='start: "a" ' + "%" * 30000)),
    Hostile("lark of 20000 nested groups", formatted(grammar="start: " + "(" * 20000 + '"a"' + ")" * 20000)),
    Hostile("ebnf of 20000 nested groups", formatted(grammar="root ::= " + "(" * 20000 + '"a"' + ")" * 20000)),
    Hostile("ebnf line of 30000 '%'", formatted(grammar='root ::= "a" ' + "%" * 30000)),
    Hostile("choice of 1024 options of 64 characters",
            formatted(choice=pb.Choice(options=[f"{i:064d}" for i in range(1024)]))),
    Hostile("choice of one 1 MB option", formatted(choice=pb.Choice(options=["z" * (1 << 20)]))),
    # metadata: two bearer tokens (which one is the caller?), headers past gRPC's limit
    Hostile("authorization twice, good then wrong", _HI, bearer("tok-alpha", "wrong"),
            REFUSED | {grpc.StatusCode.INVALID_ARGUMENT}),
    Hostile("authorization twice, wrong then good", _HI, bearer("wrong", "tok-alpha"),
            REFUSED | {grpc.StatusCode.INVALID_ARGUMENT}),
    Hostile("authorization twice, two tenants", _HI, bearer("tok-alpha", "tok-beta"),
            REFUSED | {grpc.StatusCode.INVALID_ARGUMENT}),
    Hostile("authorization of 9 KB", _HI, bearer("k" * 9 * 1024), REFUSED | METADATA_TOO_LARGE),
    Hostile("authorization of 1 MB", _HI, bearer("k" * (1 << 20)), REFUSED | METADATA_TOO_LARGE),
    Hostile("x-request-id of 9 KB", _HI, (*AUTH, ("x-request-id", "m" * 9 * 1024)), ACCEPTABLE | METADATA_TOO_LARGE),
    Hostile("x-request-id of 1 MB", _HI, (*AUTH, ("x-request-id", "m" * (1 << 20))), ACCEPTABLE | METADATA_TOO_LARGE),
    Hostile("x-request-id twice", _HI, (*AUTH, ("x-request-id", "one"), ("x-request-id", "two"))),
    Hostile("priority 99", pb.GenerateRequest(prompt="hi", stopping=_SMALL, priority=99)),  # type: ignore[arg-type]
    Hostile("priority HIGH above beta's cap",
            pb.GenerateRequest(prompt="hi", stopping=_SMALL, priority=pb.PRIORITY_HIGH), bearer("tok-beta")),
)  # fmt: skip


@pytest.mark.parametrize("hostile", HOSTILE, ids=[h.name for h in HOSTILE])
def test_a_hostile_field_value_ends_in_a_deliberate_status(
    fuzz_server: ServerProcess, rpcs: dict, hostile: Hostile
) -> None:
    outcome = call(rpcs, "Generate", hostile.request.SerializeToString(), hostile.metadata, hostile.allowed)
    assert not outcome.problems, f"{hostile.name}: {'; '.join(outcome.problems)}: {outcome.details[:300]!r}"
    assert fuzz_server.proc.poll() is None, "the server died:\n" + fuzz_server.output()


# The grammar: a valid request with one to three of its fields (and its metadata) drawn from
# these pools. Values that cost the server real time (a 1 MB prompt to tokenize) stay in HOSTILE.
hostile_text = st.sampled_from(
    ["r" * 9 * 1024, "\r\n", "a\rb\nc", "\x00", "\x01\x1b[0m\x7f", "\ufeff", "\U0001f600" * 200, ""]
)
hostile_ids = st.one_of(
    st.lists(st.sampled_from([0, 28, 49151, 49152, U32]), max_size=12),
    st.sampled_from([[28] * 5000, [U32] * 100]),
)
hostile_fields: dict[str, st.SearchStrategy[Callable[[pb.GenerateRequest], None]]] = {
    "request_id": hostile_text.map(lambda v: lambda r: setattr(r, "request_id", v)),
    "prompt": hostile_text.map(lambda v: lambda r: setattr(r, "prompt", v)),
    "chat": st.tuples(hostile_text | st.sampled_from(["user", "system"]), hostile_text).map(
        lambda rc: lambda r: r.chat.messages.add(role=rc[0], content=rc[1])
    ),
    "token_ids": hostile_ids.map(lambda v: lambda r: r.token_ids.ids.extend(v)),
    "resume": st.tuples(hostile_ids, st.sampled_from([0, 1, 2**31, U32 - 8, U32 - 1, U32])).map(
        lambda p: lambda r: r.resume.MergeFrom(pb.Resume(generated_token_ids=p[0], next_index=p[1]))
    ),
    "response_format": st.sampled_from(
        [
            pb.ResponseFormat(json_schema=nested_objects(500)),
            pb.ResponseFormat(json_schema=nested_arrays(40)),
            pb.ResponseFormat(json_schema='{"$ref":"#"}'),
            pb.ResponseFormat(json_schema='{"type":"string","maxLength":' + str(U64) + "}"),
            pb.ResponseFormat(json_schema="{" * 5000),
            pb.ResponseFormat(json_object=False),
            pb.ResponseFormat(regex="(a*)*b"),
            pb.ResponseFormat(regex="(" * 3000),
            pb.ResponseFormat(regex="\\"),
            pb.ResponseFormat(grammar='start: "' + "x" * 9000 + '"'),
            pb.ResponseFormat(grammar="start: " + "y" * 9000),
            pb.ResponseFormat(grammar="root ::= root"),
            pb.ResponseFormat(choice=pb.Choice(options=["\x00", "\r\n"])),
            pb.ResponseFormat(choice=pb.Choice(options=[])),
        ]
    ).map(lambda f: lambda r: r.response_format.CopyFrom(f)),
    "stopping": st.sampled_from(
        [
            pb.StoppingCriteria(max_new_tokens=8, min_new_tokens=U32),
            pb.StoppingCriteria(max_new_tokens=U32, time_limit_ms=1),
            pb.StoppingCriteria(max_new_tokens=4, stop_sequences=["\r\n", "\x00", "s" * 9000]),
        ]
    ).map(lambda s: lambda r: r.stopping.CopyFrom(s)),
    "priority": st.sampled_from([-1, 3, 2**31 - 1]).map(lambda p: lambda r: setattr(r, "priority", p)),
}
hostile_metadata = st.sampled_from([
    *[AUTH] * 6,  # mostly one good token, so that most hostile values reach the handler
    bearer("tok-alpha", "tok-alpha"),  # the same token twice: one caller, but two headers
    bearer("tok-beta", "wrong"),
    (*AUTH, ("x-request-id", "m" * 9 * 1024)),
    (*AUTH, ("x-request-id", "  m  ")),  # (a tab or a control character: the client refuses to send it)
])  # fmt: skip


@st.composite
def hostile_requests(draw: st.DrawFn) -> tuple[pb.GenerateRequest, tuple[tuple[str, str], ...]]:
    request = pb.GenerateRequest()
    request.CopyFrom(draw(st.sampled_from(SEEDS[:3])))
    for name in draw(st.lists(st.sampled_from(sorted(hostile_fields)), min_size=1, max_size=3, unique=True)):
        draw(hostile_fields[name])(request)
    return request, draw(hostile_metadata)


def test_requests_built_from_hostile_values_end_in_a_deliberate_status(fuzz_server: ServerProcess, rpcs: dict) -> None:
    search = Search(budget_s=6)

    @settings(max_examples=200, **FUZZ_SETTINGS)  # type: ignore[arg-type]
    @given(case=hostile_requests())
    def send(case: tuple[pb.GenerateRequest, tuple[tuple[str, str], ...]]) -> None:
        request, metadata = case
        if search.over():
            return
        headers = [k for k, _ in metadata]
        # One bearer header of a listed token is a caller; anything else is refused.
        allowed = ACCEPTABLE if headers.count("authorization") == 1 and metadata[0][1] != "Bearer wrong" else REFUSED
        allowed |= {grpc.StatusCode.INVALID_ARGUMENT}
        if sum(len(k) + len(v) for k, v in metadata) > METADATA_SOFT_LIMIT:
            allowed |= METADATA_TOO_LARGE
        outcome = call(rpcs, "Generate", request.SerializeToString(), metadata, allowed)
        search.record(f"{str(request)[:300]!r} with {[(k, v[:40]) for k, v in metadata]}", outcome)

    send()
    search.check(least=60)
    assert_serving(fuzz_server)


def test_the_server_is_serving_after_all_of_it(fuzz_server: ServerProcess, rpcs: dict) -> None:
    assert_serving(fuzz_server)
    assert call(rpcs, "Generate", _HI.SerializeToString()).code == grpc.StatusCode.OK
