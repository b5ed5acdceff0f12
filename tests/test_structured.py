"""Constrained decoding (GenerateRequest.response_format) on the engines, with xgrammar.

- The formats compile (once: a bounded cache by content), and a bad one is refused with
  the library's message and the request field.
- Every answer that ends EOS follows its format: a JSON schema (parsed and validated with
  ``jsonschema``), any JSON object, a regex, a choice, a grammar (EBNF and Lark).
- Only constrained rows are masked: an unconstrained row gives the same tokens beside
  constrained ones as without them.
- Batch invariance: twelve constrained requests, greedy and seeded, give the same tokens
  alone and together (each kernel set, and the simple engine).
- A seeded constrained row is sampled, not taken greedily: it answers unlike its greedy twin
  (same prompt and format), and its seeded repeat gives the same tokens.
- The grammar ends the answer (min_new_tokens and ignore_eos do not hold it open), and a
  resumed constrained stream continues exactly; resume ids the grammar refuses are refused.

On the tiny random model (its answers are nonsense, but the grammar holds them to the
format), and the real default model (tests/test_e2e.py has a schema on it over gRPC).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from engine_support import kernel_choices, run_all
from tokenwire_server import structured
from tokenwire_server.domain import (
    ErrorEvent,
    ErrorKind,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    InvalidResponseFormat,
    InvalidResume,
    ResponseFormat,
    SamplingOptions,
)
from tokenwire_server.engine import create_engine
from tokenwire_server.engine.base import EngineLimits
from tokenwire_server.model import load_model

pytestmark = pytest.mark.timeout(600)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "sizes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
    },
    "required": ["name", "ok", "color", "sizes"],
}
SHORT = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
    "required": ["ok", "color"],
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ("yes", "no", 'a "quoted"\nanswer', "naïve ☃ 🙂", "back\\slash")
EBNF = 'root ::= "The answer is " [0-9] [0-9]? "."'
LARK = 'start: "x=" NUMBER\nNUMBER: /[0-9]{1,3}/'

FORMATS = [
    ResponseFormat("json_schema", json.dumps(SCHEMA)),
    ResponseFormat("json_schema", json.dumps(SHORT)),
    ResponseFormat("json_object"),
    ResponseFormat("regex", REGEX),
    ResponseFormat("choice", options=CHOICES),
    ResponseFormat("grammar", EBNF),
    ResponseFormat("grammar", LARK),
]
# The formats that leave a sampled answer room to differ from greedy on every seed tried: the
# tiny model's logits are well separated, so a choice or a short grammar often draws the greedy
# answer even hot. HOT and SEED: a temperature and seed at which they do.
OPEN = [FORMATS[0], FORMATS[2], FORMATS[3]]
HOT, SEED = 2.0, 2


def follows(fmt: ResponseFormat, text: str) -> bool:
    """Whether a whole answer follows its format (checked without the library)."""
    if fmt.kind in ("json_schema", "json_object"):
        value = json.loads(text)
        if fmt.kind == "json_object":
            return isinstance(value, dict)
        jsonschema.validate(value, json.loads(fmt.spec))
        return True
    if fmt.kind == "regex":
        return re.fullmatch(fmt.spec, text) is not None
    if fmt.kind == "choice":
        return text in fmt.options
    if fmt.spec == EBNF:
        return re.fullmatch(r"The answer is [0-9][0-9]?\.", text) is not None
    return re.fullmatch(r"x=[0-9]{1,3}", text) is not None


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> Any:
    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def grammars(tiny: Any) -> structured.Grammars:
    return structured.Grammars(tiny.tokenizer, tiny.vocab_size, tiny.eos_token_ids)


def request(
    i: int, fmt: ResponseFormat | None, prompt: list[int], sampling: SamplingOptions, new: int = 40, **more: Any
) -> GenerationRequest:
    return GenerationRequest(f"r{i}", prompt, sampling, new, want_tokens=True, response_format=fmt, **more)


def engine_of(loaded: Any, kind: str, kernels: str = "torch") -> Any:
    limits = EngineLimits(max_active=16, max_queue=64, kv_cache_tokens=16 * 1024, max_prefill_tokens=24)
    if kind == "simple":
        return create_engine("simple", loaded, limits, workers=2)
    if kind == "overlap":  # the batched engine delivering each step's text while the next one runs
        return create_engine("batched", loaded, limits, workers=1, kernels=kernels, overlap="on")
    return create_engine("batched", loaded, limits, workers=1, kernels=kernels)


def run(
    loaded: Any, requests: list[GenerationRequest], kind: str = "batched", kernels: str = "torch", alone: bool = False
) -> list[Any]:
    engine = engine_of(loaded, kind, kernels)
    engine.start()
    try:
        if alone:
            return [run_all(engine, [r], 120)[0] for r in requests]
        return run_all(engine, requests, 300)
    finally:
        engine.close()


def prompts(loaded: Any, count: int) -> list[list[int]]:
    tok = loaded.tokenizer
    questions = ["Describe a fruit as JSON.", "Give me a code.", "Is the sky blue?", "What is 6 times 7?", "Say x."]
    return [tok.encode(questions[i % len(questions)] + " " * (i // len(questions))) for i in range(count)]


# -- compiling ---------------------------------------------------------------------------


def test_each_format_compiles_once_and_the_cache_is_bounded(
    grammars: structured.Grammars, monkeypatch: pytest.MonkeyPatch
) -> None:
    fmt = ResponseFormat("regex", "[a-z]{3}")
    compiled, seconds = grammars.compile(fmt)
    again, cached = grammars.compile(ResponseFormat("regex", "[a-z]{3}"))  # equal by content
    assert seconds is not None and seconds > 0 and cached is None and again is compiled
    monkeypatch.setattr(structured, "CACHE_BYTES", 1)  # room for one entry only
    grammars.compile(ResponseFormat("regex", "[a-z]{4}"))
    assert grammars.compile(fmt)[1] is not None  # evicted: compiled again
    assert grammars.compile(fmt)[1] is None


@pytest.mark.parametrize(
    ("fmt", "words"),
    [
        (ResponseFormat("json_schema", '{"type": "nonsense"}'), 'Unsupported type "nonsense"'),
        (ResponseFormat("json_schema", '{"type": "object", "properties": 5}'), "properties"),
        (ResponseFormat("regex", "a(b"), "parenthesis is not closed"),
        (ResponseFormat("grammar", "root ::= undefined_rule"), 'Rule "undefined_rule" is not defined'),
        (ResponseFormat("grammar", 'root ::= "open'), "string literal"),
        (ResponseFormat("grammar", "start: missing_rule"), "missing_rule"),
    ],
)
def test_a_format_the_library_refuses_names_its_field_and_says_why(
    grammars: structured.Grammars, fmt: ResponseFormat, words: str
) -> None:
    with pytest.raises(InvalidResponseFormat) as caught:
        grammars.compile(fmt)
    assert caught.value.field == f"response_format.{fmt.kind}"
    message = str(caught.value)
    assert (
        words in message and not message.startswith("[") and ".cc:" not in message
    )  # the message, not the C++ location


def test_a_grammar_with_a_rule_defined_by_colons_equals_is_ebnf_else_lark() -> None:
    assert not structured.is_lark('root ::= "a"') and not structured.is_lark('# comment\nroot ::= x\nx ::= "b"')
    assert structured.is_lark('start: "a"') and structured.is_lark('// root ::= "a" in a comment\nstart: "a"')


def test_a_choice_takes_exactly_its_options_whatever_they_hold(grammars: structured.Grammars, tiny: Any) -> None:
    tok = tiny.tokenizer
    fmt = ResponseFormat("choice", options=CHOICES)
    eos = tiny.eos_token_ids[0]
    for option in CHOICES:
        constraint = grammars.constraint(fmt)
        assert all(constraint.accept(t) for t in tok.encode(option)), option
        assert constraint.accept(eos) and constraint.terminated
    for other in ("yesno", "maybe", "naïve"):
        constraint = grammars.constraint(fmt)
        ids = tok.encode(other)
        assert not (all(constraint.accept(t) for t in ids) and constraint.accept(eos)), other


# -- the engines ---------------------------------------------------------------------------


def test_the_device_mask_sets_exactly_what_xgrammar_sets() -> None:
    """``apply_bitmask`` (torch ops, used off the CPU, where xgrammar's own path compiles a
    Triton kernel at run time) against xgrammar's CPU kernel: random packed masks, the sign
    bit included, some rows constrained, logits wider than the vocabulary."""
    import torch
    import xgrammar as xgr

    generator = torch.Generator().manual_seed(0)
    vocab, rows = 1000, [1, 3, 4, 6, 0]
    mask = torch.randint(-(2**31), 2**31 - 1, (len(rows), (vocab + 31) // 32), dtype=torch.int32, generator=generator)
    logits = torch.randn(7, vocab + 24, generator=generator)
    full = torch.full((7, mask.shape[1]), -1, dtype=torch.int32)  # xgrammar's: a row per logits row
    full[rows] = mask
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, full, vocab_size=vocab, indices=rows)
    got = logits.clone()
    structured.apply_bitmask(got, mask, torch.tensor(rows), vocab)
    assert torch.equal(got, expected)
    assert 0 < int((got == float("-inf")).sum()) < len(rows) * vocab  # some masked, not all
    assert torch.equal(got[[2, 5]], logits[[2, 5]]) and torch.equal(got[:, vocab:], logits[:, vocab:])


@pytest.mark.parametrize("kind", ["batched", "simple"])
def test_every_answer_that_ends_follows_its_format(tiny: Any, kind: str) -> None:
    """Each format, greedy and seeded, in one batch: an answer that ends EOS follows it."""
    base = prompts(tiny, 4)
    requests = [
        request(
            i,
            fmt,
            base[i % 4],
            SamplingOptions(temperature=0.0) if i % 2 == 0 else SamplingOptions(temperature=0.9, top_p=0.95, seed=i),
            new=96,
        )
        for i, fmt in enumerate(FORMATS * 2)
    ]
    recs = run(tiny, requests, kind)
    ended = 0
    for rec, req in zip(recs, requests, strict=True):
        last = rec.last
        assert isinstance(last, FinishEvent), last
        assert req.response_format is not None
        if last.reason is FinishReason.EOS:
            ended += 1
            assert follows(req.response_format, rec.text), (req.response_format, rec.text)
        else:
            assert last.reason is FinishReason.LENGTH and len(rec.token_ids) == req.max_new_tokens
    # The formats with nothing open-ended (SHORT, the regex, the choice, the grammars) always end.
    assert ended >= 10


@pytest.mark.parametrize("kind", ["batched", "overlap"])
def test_a_grammar_that_fails_ends_its_own_row_and_not_the_batch(
    tiny: Any, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The library raising for one row's grammar (faked: its matcher's fill) fails that row
    INTERNAL, naming the grammar, with nothing sent; the constrained and unconstrained rows
    beside it finish with the tokens they give without it."""
    bad = ResponseFormat("regex", "[0-9]{3}")
    fill, constraint = structured.Constraint.fill, structured.Grammars.constraint

    def failing(self: Any, bitmask: Any, row: int) -> None:
        if getattr(self, "bad", False):
            raise RuntimeError("matcher state is corrupt (simulated)")
        fill(self, bitmask, row)

    def marked(self: Any, fmt: ResponseFormat) -> Any:
        made = constraint(self, fmt)
        made.bad = fmt == bad
        return made

    monkeypatch.setattr(structured.Constraint, "fill", failing)
    monkeypatch.setattr(structured.Grammars, "constraint", marked)
    base = prompts(tiny, 3)
    sampled = SamplingOptions(temperature=0.9, top_p=0.95, seed=5)
    others = [
        request(1, ResponseFormat("json_object"), base[0], sampled, new=48),
        request(2, None, base[1], SamplingOptions(temperature=0.0), new=24),
    ]
    alone = run(tiny, others, kind)
    together = run(tiny, [request(0, bad, base[2], sampled), *others], kind)
    assert isinstance(together[0].last, ErrorEvent) and together[0].last.kind is ErrorKind.INTERNAL
    assert "grammar failed" in together[0].last.message and "simulated" in together[0].last.message
    assert together[0].text == "" and together[0].token_ids == []
    assert [r.token_ids for r in together[1:]] == [r.token_ids for r in alone]
    assert all(isinstance(r.last, FinishEvent) for r in together[1:])


def test_unconstrained_rows_are_untouched_by_constrained_neighbours(tiny: Any) -> None:
    base = prompts(tiny, 6)
    free = [
        request(
            i,
            None,
            base[i],
            SamplingOptions(temperature=0.0) if i % 2 else SamplingOptions(temperature=0.8, seed=5 + i),
            24,
        )
        for i in range(6)
    ]
    constrained = [request(10 + i, FORMATS[i], base[i], SamplingOptions(temperature=0.0), 24) for i in range(6)]
    alone = run(tiny, free)
    mixed = run(tiny, free + constrained)[:6]
    assert [r.token_ids for r in mixed] == [r.token_ids for r in alone]


@pytest.mark.parametrize("kernels", [*kernel_choices(), "simple engine", "overlap"])
def test_twelve_constrained_requests_give_the_same_tokens_alone_and_together(tiny: Any, kernels: str) -> None:
    kind = {"simple engine": "simple", "overlap": "overlap"}.get(kernels, "batched")
    kernels = "torch" if kernels == "overlap" else kernels
    base = prompts(tiny, 12)
    kinds = [
        SamplingOptions(temperature=0.0),
        SamplingOptions(temperature=0.8, top_p=0.9, seed=1234),
        SamplingOptions(temperature=1.0, top_k=40, repetition_penalty=1.3, seed=99),
    ]
    requests = [request(i, FORMATS[i % len(FORMATS)], base[i], kinds[i % 3], 32) for i in range(12)]
    alone = run(tiny, requests, kind, kernels, alone=True)
    together = run(tiny, requests, kind, kernels)
    for req, a, t in zip(requests, alone, together, strict=True):
        assert t.token_ids == a.token_ids, (req.response_format, req.sampling)
        assert t.last.reason == a.last.reason
    # The twelve answers are not all alike (no two here share both prompt and format: that a
    # sampled constrained row differs from its greedy twin is the next test's).
    assert len({tuple(r.token_ids) for r in together}) > 6


def test_a_seeded_constrained_row_is_sampled_not_greedy_and_repeats_exactly(tiny: Any) -> None:
    """Each open format beside its greedy twin (same prompt, same format) in one batch: the
    seeded hot row answers differently from greedy (and, where it ends, follows the format),
    and its seeded repeat gives the same tokens. (A constrained row taken greedily, whatever
    its sampling options, would answer exactly as its twin.)"""
    prompt = prompts(tiny, 1)[0]
    hot = SamplingOptions(temperature=HOT, seed=SEED)
    twins = [SamplingOptions(temperature=0.0), hot, hot]  # greedy, sampled, the sampled one's repeat
    requests = [
        request(3 * k + i, fmt, prompt, sampling, 24) for k, fmt in enumerate(OPEN) for i, sampling in enumerate(twins)
    ]
    recs = run(tiny, requests)
    for k, fmt in enumerate(OPEN):
        greedy, sampled, repeat = recs[3 * k : 3 * k + 3]
        assert sampled.token_ids != greedy.token_ids, (fmt, greedy.text, sampled.text)
        assert repeat.token_ids == sampled.token_ids, (fmt, sampled.text, repeat.text)
        for rec in (greedy, sampled):
            if rec.last.reason is FinishReason.EOS:
                assert follows(fmt, rec.text), (fmt, rec.text)


@pytest.mark.e2e
def test_twelve_constrained_requests_on_the_default_model_are_batch_invariant_and_valid(
    default_model_dir: Path,
) -> None:
    """The real model: the same twelve constrained chats (greedy, seeded top-p, seeded top-k
    with a penalty) give the same tokens alone and together, and each complete answer is valid."""
    loaded = load_model(str(default_model_dir), device="cpu", dtype="float32")
    tok = loaded.tokenizer
    asks = ["Describe a fruit as JSON.", "Give me a product code.", "Is the sky blue?", "What is 6 times 7?"]
    kinds = [
        SamplingOptions(temperature=0.0),
        SamplingOptions(temperature=0.8, top_p=0.9, seed=1234),
        SamplingOptions(temperature=1.0, top_k=40, repetition_penalty=1.3, seed=99),
    ]
    formats = [FORMATS[1], FORMATS[3], FORMATS[4], FORMATS[5]]
    requests = []
    for i in range(12):
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": asks[i % 4]}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        requests.append(request(i, formats[i % 4], prompt, kinds[i % 3], 48))
    engine = engine_of(loaded, "batched", "auto")
    engine.start()
    try:
        alone = [run_all(engine, [r], 120)[0] for r in requests]
        together = run_all(engine, requests, 300)
    finally:
        engine.close()
    for req, a, t in zip(requests, alone, together, strict=True):
        assert t.token_ids == a.token_ids, (req.response_format, req.sampling)
        assert req.response_format is not None and t.last.reason is FinishReason.EOS
        assert follows(req.response_format, t.text), t.text


def test_the_grammar_ends_the_answer_even_with_min_new_tokens_and_ignore_eos(tiny: Any) -> None:
    fmt = ResponseFormat("choice", options=("yes", "no"))
    base = prompts(tiny, 1)[0]
    held = [
        request(0, fmt, base, SamplingOptions(temperature=0.0), 30, min_new_tokens=20),
        request(1, fmt, base, SamplingOptions(temperature=0.0), 30, ignore_eos=True),
    ]
    for rec in run(tiny, held):
        assert rec.last.reason is FinishReason.EOS and rec.text in ("yes", "no")
        assert len(rec.token_ids) < 20 and rec.token_ids[-1] in tiny.eos_token_ids


@pytest.mark.parametrize("kind", ["batched", "simple"])
def test_a_resumed_constrained_stream_continues_exactly(tiny: Any, kind: str) -> None:
    base = prompts(tiny, 3)
    requests = [
        request(0, FORMATS[0], base[0], SamplingOptions(temperature=0.0), 48),
        request(1, FORMATS[3], base[1], SamplingOptions(temperature=0.9, seed=7), 48),
        request(2, FORMATS[5], base[2], SamplingOptions(temperature=1.0, top_k=30, seed=8), 48),
    ]
    uncut = run(tiny, requests, kind)
    resumed = []
    for req, rec in zip(requests, uncut, strict=True):
        cut = max(1, len(rec.token_ids) // 2)
        resumed.append(dataclasses.replace(req, resume_ids=tuple(rec.token_ids[:cut])))
    again = run(tiny, resumed, kind)
    for req, rec, whole in zip(resumed, again, uncut, strict=True):
        assert list(req.resume_ids) + rec.token_ids == whole.token_ids
        assert rec.last.reason == whole.last.reason


def test_resume_ids_the_grammar_refuses_are_an_invalid_resume(tiny: Any) -> None:
    tok = tiny.tokenizer
    engine = engine_of(tiny, "batched")
    try:
        bad = request(
            0,
            ResponseFormat("regex", "[0-9]+"),
            prompts(tiny, 1)[0],
            SamplingOptions(temperature=0.0),
            resume_ids=tuple(tok.encode("12ab")),
        )
        with pytest.raises(InvalidResume, match="does not follow the request's response_format"):
            engine.submit(bad, lambda event: None)
    finally:
        engine.close()
