"""Every rule the tokenwire API enforces on a request, in one place.

The server runs these checks on each request (with its own limits) and the client
library runs the same checks before sending (with the limits it knows), so both
give the same message for the same mistake. A violation names the request field
in the dotted form used by ``google.rpc.BadRequest.FieldViolation.field``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from enum import Enum

from tokenwire.v1 import generation_pb2 as pb

CHAT_ROLES = ("system", "user", "assistant")
# Most alternatives per token (OutputOptions.top_logprobs, prompt_top_logprobs): OpenAI's bound.
MAX_TOP_LOGPROBS = 20
# OpenAI's bounds: presence and frequency penalties, and a logit bias (whose floor bans the token).
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
MAX_REQUEST_ID_CHARS = 128
# Longest schema, regex or grammar (characters), and most options of a choice.
MAX_FORMAT_CHARS = 64 * 1024
MAX_CHOICE_OPTIONS = 1024
# Deepest nesting of arrays and objects in a json_schema document, checked without recursion
# before it is parsed: compiling a schema grows much faster than its depth (xgrammar: 0.03 s at
# 64 levels, 0.4 s at 200, 2.9 s at 400), and the JSON parser itself recurses.
MAX_JSON_SCHEMA_DEPTH = 64
# Most characters of a caller's value that an error message (or its details, or a log line)
# quotes; past it the quote ends with how long the value was.
MAX_QUOTED_CHARS = 64
# A chunk's index is a uint32: resume.next_index + max_new_tokens must not pass it.
MAX_CHUNK_INDEX = 2**32 - 1
FORMAT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class Rule(str, Enum):
    """The message of each rule; ``.format`` fills the blanks."""

    EMPTY_INPUT = "one of prompt, chat or token_ids must be set and non-empty"
    EMPTY_TEXT = "must not be empty"
    REQUEST_ID_TOO_LONG = "has {count} characters; at most " + str(MAX_REQUEST_ID_CHARS) + " are allowed"
    NO_MESSAGES = "must hold at least one message"
    TOO_MANY_MESSAGES = "holds {count} messages; at most {limit} are allowed"
    UNKNOWN_ROLE = "unknown role {role}; expected one of " + ", ".join(CHAT_ROLES)
    TOKEN_OUT_OF_VOCAB = "token id {value} is outside the vocabulary [0, {limit})"
    RESUME_OVER_MAX = "holds {count} tokens, more than max_new_tokens ({limit})"
    RESUME_INDEX_OVERFLOW = (
        "is {value}; with up to {limit} more chunks the stream's chunk index would pass "
        + str(MAX_CHUNK_INDEX)
        + " (next_index + max_new_tokens must be at most that)"
    )
    TEMPERATURE = "must be a finite number >= 0 (0 is greedy), got {value}"
    TOP_P = "must be in (0, 1], got {value}"
    REPETITION_PENALTY = "must be a finite number > 0, got {value}"
    PENALTY = "must be a finite number in [-2, 2], got {value}"
    MIN_P = "must be in [0, 1], got {value}"
    LOGIT_BIAS = "must be a finite number in [-100, 100] (-100 bans the token), got {value}"
    TOO_MANY_LOGIT_BIAS = "holds {count} entries; at most {limit} are allowed"
    MAX_NEW_TOKENS_ZERO = "must be at least 1 (0 only scores the prompt: set output.prompt_logprobs)"
    MAX_NEW_TOKENS_CAP = "is {value}, above this server's cap of {limit}"
    MIN_OVER_MAX = "is {value}, above max_new_tokens ({limit})"
    TOO_MANY_STOPS = "holds {count} stop sequences; at most {limit} are allowed"
    EMPTY_STOP = "stop sequence {index} is empty"
    STOP_TOO_LONG = "stop sequence {index} has {count} characters; at most {limit} are allowed"
    TOO_MANY_STOP_TOKENS = "holds {count} stop token ids; at most {limit} are allowed"
    TOP_LOGPROBS = "must be between 0 and {limit}, got {value}"
    TOO_MANY_LOGPROBS_OF = "holds {count} token ids; at most {limit} are allowed"
    TOO_MANY_SAMPLES = "is {value}; at most {limit} samples per call are allowed"
    RESUME_OF_SAMPLES = (
        "a call of {value} samples cannot be resumed whole: resume each sample as a call of its own "
        "(n unset, sampling.seed that sample's seed, its tokens and next_index)"
    )
    PROMPT_TOO_LONG = (
        "the prompt is {count} tokens; with max_new_tokens={value} it needs {total}, "
        "above the {limit} tokens one request may hold on this server (the model's context, "
        "or the KV-cache budget where that is smaller)"
    )
    PROMPT_OVER_LIMIT = (
        "the prompt ({chars} characters) is more than {limit} tokens, the most one request may hold on this "
        "server (the model's context, or the KV-cache budget where that is smaller); it was not read whole"
    )
    INVALID_UTF8 = "is not valid text (lone surrogate or NUL character)"
    UNPRINTABLE = "must be printable text (no control characters such as CR or LF)"
    NO_CHAT_TEMPLATE = "this model has no chat template; send a prompt or token_ids instead"
    UNKNOWN_PRIORITY = (
        "is {value}, not a Priority; expected PRIORITY_UNSPECIFIED (0), PRIORITY_HIGH (1) or PRIORITY_LOW (2)"
    )
    PRIORITY_ABOVE_CAP = "{value} is above what tenant {tenant!r} may ask for (at most {limit})"
    NO_FORMAT = "set one of " + ", ".join(FORMAT_KINDS)
    FORMAT_TOO_LONG = "has {count} characters; at most " + str(MAX_FORMAT_CHARS) + " are allowed"
    NOT_JSON = "is not valid JSON: {error}"
    SCHEMA_TOO_DEEP = (
        "nests arrays and objects more than "
        + str(MAX_JSON_SCHEMA_DEPTH)
        + " levels deep; at most "
        + str(MAX_JSON_SCHEMA_DEPTH)
        + " are allowed"
    )
    SCHEMA_NOT_OBJECT = "must be a JSON object (a JSON Schema document), got {kind}"
    JSON_OBJECT_FALSE = "must be true (leave response_format unset for free text)"
    NO_OPTIONS = "must hold at least one option"
    TOO_MANY_OPTIONS = "holds {count} options; at most " + str(MAX_CHOICE_OPTIONS) + " are allowed"

    def error(self, **blanks: object) -> str:
        return self.value.format(**blanks)


@dataclasses.dataclass(frozen=True)
class FieldViolation:
    field: str
    description: str

    def __str__(self) -> str:
        return f"{self.field}: {self.description}"


@dataclasses.dataclass(frozen=True)
class Limits:
    """A server's limits that a request is checked against. None: not known here (skip the check).

    The server checks its own limits on every request. A client that wants the same
    checks before sending takes them from the server it talks to
    (``Limits.from_model_info``), never from copied defaults: servers differ.
    """

    max_new_tokens_limit: int | None = None
    max_stop_sequences: int | None = None
    max_stop_sequence_chars: int | None = None
    max_chat_messages: int | None = None
    vocab_size: int | None = None
    max_stop_token_ids: int | None = None
    max_logit_bias: int | None = None
    max_logprobs_of: int | None = None
    max_top_logprobs: int = MAX_TOP_LOGPROBS
    max_n: int | None = None

    @classmethod
    def from_model_info(cls, info: pb.ModelInfo) -> Limits:
        """The limits a server publishes in ``GetModelInfo`` (``ModelInfo.limits``)."""
        if not info.HasField("limits"):  # a server older than ModelInfo.limits
            return cls(max_new_tokens_limit=info.max_new_tokens_limit or None, vocab_size=info.vocab_size or None)
        limits = info.limits
        return cls(
            max_new_tokens_limit=limits.max_new_tokens_limit,
            max_stop_sequences=limits.max_stop_sequences,
            max_stop_sequence_chars=limits.max_stop_sequence_chars,
            max_chat_messages=limits.max_chat_messages,
            vocab_size=limits.vocab_size,
            max_stop_token_ids=limits.max_stop_token_ids,
            max_logit_bias=limits.max_logit_bias,
            max_logprobs_of=limits.max_logprobs_of or None,  # 0: a server older than the field
            max_top_logprobs=limits.max_top_logprobs or MAX_TOP_LOGPROBS,
            max_n=limits.max_n or 1,  # 0: a server older than GenerateRequest.n serves one sample
        )


def quoted(value: str) -> str:
    """``value`` as an error message quotes it: its repr, cut to ``MAX_QUOTED_CHARS`` characters
    (then saying how long it was), so that what a caller sends never makes a reply or a log
    line grow with it."""
    if len(value) <= MAX_QUOTED_CHARS:
        return repr(value)
    return f"{value[:MAX_QUOTED_CHARS]!r}... ({len(value)} characters)"


def json_depth_over(text: str, limit: int) -> bool:
    """Whether the JSON text ``text`` nests arrays and objects more than ``limit`` deep; one pass,
    no recursion, brackets inside strings ignored (the text need not be valid JSON)."""
    depth = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return True
        elif ch in "]}":
            depth -= 1
    return False


def _bad_text(text: str) -> bool:
    if "\x00" in text:
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def validate_generate_request(request: pb.GenerateRequest, limits: Limits) -> list[FieldViolation]:
    """All violations of one GenerateRequest; empty when it may be served."""
    out: list[FieldViolation] = []

    def bad(field: str, rule: Rule, **blanks: object) -> None:
        out.append(FieldViolation(field, rule.error(**blanks)))

    def token_list(field: str, ids: Sequence[int], most: int | None, too_many: Rule) -> None:
        """A list of token ids: at most ``most`` of them, each in the vocabulary (the first bad one named)."""
        if most is not None and len(ids) > most:
            bad(field, too_many, count=len(ids), limit=most)
        elif limits.vocab_size is not None:
            for i, value in enumerate(ids):
                if value >= limits.vocab_size:
                    bad(f"{field}[{i}]", Rule.TOKEN_OUT_OF_VOCAB, value=value, limit=limits.vocab_size)
                    break

    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        bad("request_id", Rule.REQUEST_ID_TOO_LONG, count=len(request.request_id))
    elif _bad_text(request.request_id):
        bad("request_id", Rule.INVALID_UTF8)
    elif not request.request_id.isprintable():
        bad("request_id", Rule.UNPRINTABLE)

    kind = request.WhichOneof("input")
    if kind is None:
        bad("input", Rule.EMPTY_INPUT)
    elif kind == "prompt":
        if not request.prompt:
            bad("prompt", Rule.EMPTY_TEXT)
        elif _bad_text(request.prompt):
            bad("prompt", Rule.INVALID_UTF8)
    elif kind == "chat":
        out.extend(validate_chat(request.chat, limits, "chat"))
    elif kind == "token_ids":
        ids = request.token_ids.ids
        if not ids:
            bad("token_ids.ids", Rule.EMPTY_TEXT)
        elif limits.vocab_size is not None:
            for i, value in enumerate(ids):
                if value >= limits.vocab_size:
                    bad(f"token_ids.ids[{i}]", Rule.TOKEN_OUT_OF_VOCAB, value=value, limit=limits.vocab_size)
                    break

    if limits.max_n is not None and request.n > limits.max_n:
        bad("n", Rule.TOO_MANY_SAMPLES, value=request.n, limit=limits.max_n)
    if request.n > 1 and (request.resume.generated_token_ids or request.resume.next_index):
        bad("resume", Rule.RESUME_OF_SAMPLES, value=request.n)

    if request.priority not in pb.Priority.values():
        bad("priority", Rule.UNKNOWN_PRIORITY, value=request.priority)

    resumed = request.resume.generated_token_ids
    if limits.vocab_size is not None:
        for i, value in enumerate(resumed):
            if value >= limits.vocab_size:
                bad(f"resume.generated_token_ids[{i}]", Rule.TOKEN_OUT_OF_VOCAB, value=value, limit=limits.vocab_size)
                break
    if request.stopping.HasField("max_new_tokens") and len(resumed) > request.stopping.max_new_tokens >= 1:
        bad(
            "resume.generated_token_ids",
            Rule.RESUME_OVER_MAX,
            count=len(resumed),
            limit=request.stopping.max_new_tokens,
        )
    # Chunk indexes run from next_index up by at most one per token: they must stay a uint32.
    # Without max_new_tokens the server's cap bounds the stream (the server checks again with
    # the max_new_tokens it settles on).
    most_new = (
        request.stopping.max_new_tokens if request.stopping.HasField("max_new_tokens") else limits.max_new_tokens_limit
    )
    next_index = request.resume.next_index
    if most_new is not None and next_index + most_new > MAX_CHUNK_INDEX:
        bad("resume.next_index", Rule.RESUME_INDEX_OVERFLOW, value=next_index, limit=most_new)

    sampling = request.sampling
    if sampling.HasField("temperature"):
        t = sampling.temperature
        if not math.isfinite(t) or t < 0:
            bad("sampling.temperature", Rule.TEMPERATURE, value=t)
    if sampling.HasField("top_p"):
        p = sampling.top_p
        if not (math.isfinite(p) and 0 < p <= 1):
            bad("sampling.top_p", Rule.TOP_P, value=p)
    if sampling.HasField("repetition_penalty"):
        r = sampling.repetition_penalty
        if not (math.isfinite(r) and r > 0):
            bad("sampling.repetition_penalty", Rule.REPETITION_PENALTY, value=r)
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(sampling, name)
        if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
            bad(f"sampling.{name}", Rule.PENALTY, value=value)
    if not (math.isfinite(sampling.min_p) and 0 <= sampling.min_p <= 1):
        bad("sampling.min_p", Rule.MIN_P, value=sampling.min_p)
    biases = sampling.logit_bias
    if limits.max_logit_bias is not None and len(biases) > limits.max_logit_bias:
        bad("sampling.logit_bias", Rule.TOO_MANY_LOGIT_BIAS, count=len(biases), limit=limits.max_logit_bias)
    else:
        for token in sorted(biases):  # a map's order is not the caller's: the first bad id, by value
            bias = biases[token]
            if limits.vocab_size is not None and token >= limits.vocab_size:
                bad(f"sampling.logit_bias[{token}]", Rule.TOKEN_OUT_OF_VOCAB, value=token, limit=limits.vocab_size)
                break
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                bad(f"sampling.logit_bias[{token}]", Rule.LOGIT_BIAS, value=bias)
                break

    stopping = request.stopping
    if stopping.HasField("max_new_tokens"):
        m = stopping.max_new_tokens
        scores_only = request.output.prompt_logprobs or request.output.prompt_top_logprobs > 0
        if m < 1 and not scores_only:
            bad("stopping.max_new_tokens", Rule.MAX_NEW_TOKENS_ZERO)
        elif limits.max_new_tokens_limit is not None and m > limits.max_new_tokens_limit:
            bad("stopping.max_new_tokens", Rule.MAX_NEW_TOKENS_CAP, value=m, limit=limits.max_new_tokens_limit)
        if stopping.min_new_tokens > m >= 1:
            bad("stopping.min_new_tokens", Rule.MIN_OVER_MAX, value=stopping.min_new_tokens, limit=m)
    elif limits.max_new_tokens_limit is not None and stopping.min_new_tokens > limits.max_new_tokens_limit:
        bad(
            "stopping.min_new_tokens",
            Rule.MIN_OVER_MAX,
            value=stopping.min_new_tokens,
            limit=limits.max_new_tokens_limit,
        )
    stops = stopping.stop_sequences
    if limits.max_stop_sequences is not None and len(stops) > limits.max_stop_sequences:
        bad("stopping.stop_sequences", Rule.TOO_MANY_STOPS, count=len(stops), limit=limits.max_stop_sequences)
    else:
        for i, stop in enumerate(stops):
            field = f"stopping.stop_sequences[{i}]"
            if not stop:
                bad(field, Rule.EMPTY_STOP, index=i)
            elif limits.max_stop_sequence_chars is not None and len(stop) > limits.max_stop_sequence_chars:
                bad(field, Rule.STOP_TOO_LONG, index=i, count=len(stop), limit=limits.max_stop_sequence_chars)
            elif _bad_text(stop):
                bad(field, Rule.INVALID_UTF8)

    token_list("stopping.stop_token_ids", stopping.stop_token_ids, limits.max_stop_token_ids, Rule.TOO_MANY_STOP_TOKENS)

    output = request.output
    for name in ("top_logprobs", "prompt_top_logprobs"):
        value = getattr(output, name)
        if value > limits.max_top_logprobs:
            bad(f"output.{name}", Rule.TOP_LOGPROBS, value=value, limit=limits.max_top_logprobs)
    token_list("output.logprobs_of", output.logprobs_of, limits.max_logprobs_of, Rule.TOO_MANY_LOGPROBS_OF)
    if request.HasField("response_format"):
        out.extend(validate_response_format(request.response_format))
    return out


def validate_response_format(fmt: pb.ResponseFormat) -> list[FieldViolation]:
    """The rules a response format must meet before the server compiles it (the compiler's
    own errors, such as an unsupported schema keyword or a bad regex, come from the server)."""
    kind = fmt.WhichOneof("format")
    if kind is None:
        return [FieldViolation("response_format", Rule.NO_FORMAT.error())]
    field = f"response_format.{kind}"
    if kind == "json_object":
        return [] if fmt.json_object else [FieldViolation(field, Rule.JSON_OBJECT_FALSE.error())]
    if kind == "choice":
        options = fmt.choice.options
        if not options:
            return [FieldViolation("response_format.choice.options", Rule.NO_OPTIONS.error())]
        if len(options) > MAX_CHOICE_OPTIONS:
            return [FieldViolation("response_format.choice.options", Rule.TOO_MANY_OPTIONS.error(count=len(options)))]
        total = sum(len(option) for option in options)
        if total > MAX_FORMAT_CHARS:
            return [FieldViolation("response_format.choice.options", Rule.FORMAT_TOO_LONG.error(count=total))]
        for i, option in enumerate(options):
            if _bad_text(option):
                return [FieldViolation(f"response_format.choice.options[{i}]", Rule.INVALID_UTF8.error())]
        return []
    text: str = getattr(fmt, kind)
    if not text:
        return [FieldViolation(field, Rule.EMPTY_TEXT.error())]
    if len(text) > MAX_FORMAT_CHARS:
        return [FieldViolation(field, Rule.FORMAT_TOO_LONG.error(count=len(text)))]
    if _bad_text(text):
        return [FieldViolation(field, Rule.INVALID_UTF8.error())]
    if kind == "json_schema":
        if json_depth_over(text, MAX_JSON_SCHEMA_DEPTH):
            return [FieldViolation(field, Rule.SCHEMA_TOO_DEEP.error())]
        try:
            schema = json.loads(text)
        except (ValueError, RecursionError) as exc:
            return [FieldViolation(field, Rule.NOT_JSON.error(error=exc))]
        if not isinstance(schema, dict):
            kinds = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
            return [FieldViolation(field, Rule.SCHEMA_NOT_OBJECT.error(kind=kinds.get(type(schema), "null")))]
    return []


def validate_chat(chat: pb.Chat, limits: Limits, field: str) -> list[FieldViolation]:
    out: list[FieldViolation] = []
    messages = chat.messages
    if not messages:
        out.append(FieldViolation(f"{field}.messages", Rule.NO_MESSAGES.error()))
        return out
    if limits.max_chat_messages is not None and len(messages) > limits.max_chat_messages:
        out.append(
            FieldViolation(
                f"{field}.messages",
                Rule.TOO_MANY_MESSAGES.error(count=len(messages), limit=limits.max_chat_messages),
            )
        )
        return out
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            out.append(
                FieldViolation(f"{field}.messages[{i}].role", Rule.UNKNOWN_ROLE.error(role=quoted(message.role)))
            )
        if _bad_text(message.content):
            out.append(FieldViolation(f"{field}.messages[{i}].content", Rule.INVALID_UTF8.error()))
    return out


def validate_tokenize_request(request: pb.TokenizeRequest, limits: Limits) -> list[FieldViolation]:
    kind = request.WhichOneof("input")
    if kind is None:
        return [FieldViolation("input", "one of text or chat must be set")]
    if kind == "chat":
        return validate_chat(request.chat, limits, "chat")
    if _bad_text(request.text):
        return [FieldViolation("text", Rule.INVALID_UTF8.error())]
    return []
