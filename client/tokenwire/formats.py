"""Response formats: answers that follow a JSON schema, a regex, a choice or a grammar.

``generate(..., response_format=...)`` takes any of:

- a JSON schema as a dict (``{"type": "object", ...}``);
- a pydantic model class (where pydantic is installed): its ``model_json_schema()``;
- a ``tokenwire.v1.ResponseFormat`` message, as the helpers here build it:
  ``json_schema(...)``, ``json_object()``, ``regex(...)``, ``choice([...])``,
  ``grammar(...)``.

``Client.generate_json`` asks for an answer in a schema and returns it parsed (a
pydantic instance for a pydantic class). An answer cut by ``max_new_tokens``
(FINISH_REASON_LENGTH) is a valid prefix, not a whole answer: ``parse_answer`` raises
``IncompleteAnswer`` for it instead of a JSON error.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from tokenwire.results import Completion, FinishReason
from tokenwire.v1 import generation_pb2 as pb

__all__ = [
    "IncompleteAnswer",
    "ResponseFormatLike",
    "choice",
    "grammar",
    "json_object",
    "json_schema",
    "parse_answer",
    "regex",
    "response_format",
]

# A schema dict, a pydantic model class, or the message itself.
ResponseFormatLike = pb.ResponseFormat | Mapping[str, Any] | type


class IncompleteAnswer(ValueError):
    """The answer ended before its format was complete (max_new_tokens, the time limit or a stop
    sequence came first): ``text`` holds what came, a valid prefix of an answer."""

    def __init__(self, completion: Completion) -> None:
        reason = completion.finish_reason.value if completion.finish_reason else "none"
        super().__init__(
            f"the answer ended ({reason}) before its format was complete; raise max_new_tokens "
            f"(it has {len(completion.text)} characters)"
        )
        self.completion = completion
        self.text = completion.text


def _is_model_class(value: object) -> bool:
    return isinstance(value, type) and callable(getattr(value, "model_json_schema", None))


def json_schema(schema: Mapping[str, Any] | str) -> pb.ResponseFormat:
    """An answer that validates against a JSON schema (a dict, or its JSON text)."""
    return pb.ResponseFormat(json_schema=schema if isinstance(schema, str) else json.dumps(schema))


def json_object() -> pb.ResponseFormat:
    """Any JSON object."""
    return pb.ResponseFormat(json_object=True)


def regex(pattern: str) -> pb.ResponseFormat:
    """An answer the whole of which matches ``pattern``."""
    return pb.ResponseFormat(regex=pattern)


def choice(options: Iterable[str]) -> pb.ResponseFormat:
    """Exactly one of ``options``."""
    return pb.ResponseFormat(choice=pb.Choice(options=list(options)))


def grammar(text: str) -> pb.ResponseFormat:
    """An answer in a grammar: EBNF/GBNF (the start rule is ``root``), or Lark."""
    return pb.ResponseFormat(grammar=text)


def response_format(value: ResponseFormatLike) -> pb.ResponseFormat:
    """The ResponseFormat message for a schema dict, a pydantic model class or the message."""
    if isinstance(value, pb.ResponseFormat):
        return value
    if _is_model_class(value):
        return json_schema(value.model_json_schema())  # type: ignore[union-attr]
    if isinstance(value, Mapping):
        return json_schema(value)
    raise TypeError(
        "response_format takes a JSON schema (dict), a pydantic model class or a tokenwire.v1.ResponseFormat, "
        f"not {type(value).__name__}"
    )


def parse_answer(completion: Completion, fmt: ResponseFormatLike | None = None) -> Any:
    """The answer of a completion in a JSON format, parsed: an instance of ``fmt`` for a pydantic
    model class, else the JSON value. Raises ``IncompleteAnswer`` when it did not end whole."""
    if completion.finish_reason is not FinishReason.EOS:  # length, time limit or a stop sequence cut it
        raise IncompleteAnswer(completion)
    if fmt is not None and _is_model_class(fmt):
        return fmt.model_validate_json(completion.text)  # type: ignore[union-attr]
    return json.loads(completion.text)
