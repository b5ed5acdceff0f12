"""End-to-end on the real default model (SmolLM2-135M-Instruct): quality-free but real."""

from __future__ import annotations

import re

import pytest
from tokenwire.v1 import generation_pb2 as pb
from tokenwire.v1 import generation_pb2_grpc as pb_grpc
from transformers import AutoTokenizer

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stub(default_server):
    with default_server.channel() as channel:
        yield pb_grpc.TextGenerationStub(channel)


def chat(stub, content, **kwargs):
    request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=content)]), **kwargs)
    chunks = list(stub.Generate(request, timeout=180))
    return "".join(c.text for c in chunks), chunks


def test_chat_answer_is_english(stub):
    text, chunks = chat(stub, "What is the capital of France?", stopping=pb.StoppingCriteria(max_new_tokens=48))
    assert "Paris" in text
    words = re.findall(r"[A-Za-z]+", text)
    assert len(words) >= 3
    assert chunks[-1].finish_reason in (pb.FINISH_REASON_EOS, pb.FINISH_REASON_LENGTH)
    assert len(chunks) > 2  # streamed, not one blob


def test_greedy_runs_are_reproducible(stub):
    kwargs = {"sampling": pb.SamplingParams(temperature=0), "stopping": pb.StoppingCriteria(max_new_tokens=32)}
    first, _ = chat(stub, "Name three fruits.", **kwargs)
    second, _ = chat(stub, "Name three fruits.", **kwargs)
    assert first and first == second


def test_seeds_reproduce(stub):
    stopping = pb.StoppingCriteria(max_new_tokens=32, ignore_eos=True)
    seeded = pb.SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    a, _ = chat(stub, "Write a sentence about the sea.", sampling=seeded, stopping=stopping)
    b, _ = chat(stub, "Write a sentence about the sea.", sampling=seeded, stopping=stopping)
    c, _ = chat(stub, "Write a sentence about the sea.", sampling=pb.SamplingParams(temperature=0.9, top_p=0.95, seed=8), stopping=stopping)
    assert a == b
    assert a != c


def test_model_info_describes_the_default_model(stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.name == "SmolLM2-135M-Instruct"
    assert info.context_length == 8192 and info.has_chat_template
    assert info.engine == "batched"
    # Device-agnostic: float32 on a CPU; bf16 (or fp16 on older cards) where --device auto finds a GPU.
    if info.device == "cpu":
        assert info.dtype == "float32"
    else:
        assert info.device.startswith("cuda") and info.dtype in ("bfloat16", "float16")
    assert info.limits.context_length == 8192 and info.limits.vocab_size == info.vocab_size


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


def decoded(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def ids_of(chunks):
    return [t.id for c in chunks for t in c.tokens]


@pytest.mark.parametrize(
    "request_",
    [
        pb.GenerateRequest(prompt="Café crème, naïve façade: "),
        pb.GenerateRequest(prompt="日本語の文章を書いてください。東京は"),
        pb.GenerateRequest(prompt="Emoji story: 🧑‍🚀🚀🌕 then 🎉"),
        pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="Réponds en français avec des emoji 🎉: où est Kyōto (京都)?")])),
        pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="Write three Chinese characters and an emoji.")])),
    ],
    ids=["accents", "cjk", "emoji", "chat-mixed", "chat-cjk"],
)
@pytest.mark.parametrize("seed", [None, 11], ids=["greedy", "sampled"])
def test_streamed_text_equals_the_decoded_ids(stub, tokenizer, request_, seed):
    """The concatenated chunks are exactly decode(ids) of the generated tokens, on the real
    tokenizer's byte-level BPE (multi-token characters, accents, CJK, emoji)."""
    request = pb.GenerateRequest()
    request.CopyFrom(request_)
    request.stopping.CopyFrom(pb.StoppingCriteria(max_new_tokens=48, ignore_eos=True))
    request.output.token_ids = True
    if seed is None:
        request.sampling.temperature = 0
    else:
        request.sampling.CopyFrom(pb.SamplingParams(temperature=1.0, top_p=0.95, seed=seed))
    chunks = list(stub.Generate(request, timeout=180))
    ids = ids_of(chunks)
    assert len(ids) == 48 == chunks[-1].usage.completion_tokens
    text = "".join(c.text for c in chunks)
    assert text == decoded(tokenizer, ids)
    assert all("\ufffd" not in c.text for c in chunks[:-1])  # no half characters mid-stream


CAPITAL = "What is the capital of France?"


def greedy_chat(stub, stopping, content=CAPITAL):
    request = pb.GenerateRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=content)]),
        sampling=pb.SamplingParams(temperature=0),
        stopping=stopping,
        output=pb.OutputOptions(token_ids=True),
    )
    return list(stub.Generate(request, timeout=180))


def test_the_model_ends_its_answer_with_eos(stub, tokenizer):
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    chunks = greedy_chat(stub, pb.StoppingCriteria(max_new_tokens=96))
    ids = ids_of(chunks)
    assert chunks[-1].finish_reason == pb.FINISH_REASON_EOS
    assert ids[-1] in info.eos_token_ids and not any(i in info.eos_token_ids for i in ids[:-1])
    assert chunks[-1].usage.completion_tokens == len(ids) < 96
    assert "Paris" in "".join(c.text for c in chunks) == decoded(tokenizer, ids)


def test_min_new_tokens_holds_eos_back_and_ignore_eos_runs_past_it(stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    natural = ids_of(greedy_chat(stub, pb.StoppingCriteria(max_new_tokens=96)))
    n = len(natural)  # the answer's length, EOS included
    minimum = n + 8
    held = greedy_chat(stub, pb.StoppingCriteria(max_new_tokens=minimum + 40, min_new_tokens=minimum))
    held_ids = ids_of(held)
    assert len(held_ids) >= minimum
    assert not any(i in info.eos_token_ids for i in held_ids[:minimum])  # EOS was never picked before the minimum
    assert held_ids[: n - 1] == natural[: n - 1]  # the same answer up to where EOS came
    past = greedy_chat(stub, pb.StoppingCriteria(max_new_tokens=n + 20, ignore_eos=True))
    past_ids = ids_of(past)
    assert past[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert len(past_ids) == past[-1].usage.completion_tokens == n + 20
    assert past_ids[:n] == natural  # EOS was generated and generation went on
