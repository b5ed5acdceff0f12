"""The text room with the real tokenizer: exact streaming, whole characters, stop sequences."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenwire_server.text import Detokenizer, OffsetDetokenizer, SharedTokenizer, StopMatcher, TextStream

SAMPLES = [
    "Hello, world! The café serves crème brûlée and jalapeño piñatas.",
    "Emoji: 👋🏽 🧑‍🚀 🇫🇷 ❤️‍🔥 done",
    "中文：我爱自然语言处理。日本語のテキスト、한국어 텍스트.",
    "Mixed: naïve façade — “quotes” … Ω≈ç√∫ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "  leading spaces, tabs\tand\nnew lines\n\n",
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def stream(tokenizer, ids):
    detok = Detokenizer(tokenizer)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("text", SAMPLES)
def test_stream_is_exact_and_never_splits_a_character(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) == text
    for piece in pieces:
        assert "\ufffd" not in piece
        piece.encode("utf-8")  # a lone surrogate would raise


def test_multibyte_characters_span_several_tokens(tokenizer):
    ids = tokenizer("🧑‍🚀", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1  # byte-level BPE splits it: the test above would be vacuous otherwise
    pieces = stream(tokenizer, ids)
    assert [p for p in pieces if p] == ["🧑‍🚀"] or "".join(pieces) == "🧑‍🚀"
    assert all("\ufffd" not in p for p in pieces)


def test_cut_mid_character_ends_like_the_full_decode(tokenizer):
    ids = tokenizer("ok 🧑‍🚀", add_special_tokens=False)["input_ids"][:-1]
    pieces = stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40))
def test_any_text_streams_exactly(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = stream(tokenizer, ids)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) == full
    if "\ufffd" not in full:  # some code points have no byte tokens and decode to U+FFFD themselves
        assert all("\ufffd" not in p for p in pieces)


def test_stop_matcher_holds_back_only_what_could_match():
    matcher = StopMatcher(["STOP"])
    assert matcher.push("abc S") == ("abc ", False)
    assert matcher.push("T") == ("", False)
    assert matcher.push("x") == ("STx", False)  # the held text could not become STOP after all
    assert matcher.push("ST") == ("", False)
    assert matcher.push("OP tail") == ("", True)
    assert matcher.matched == "STOP"


def test_stop_matcher_include_and_earliest_end():
    matcher = StopMatcher(["world", "lo w"], include_stop=True)
    assert matcher.push("hello world") == ("hello w", True)
    matcher = StopMatcher(["\n\n"])
    assert matcher.push("line one\n") == ("line one", False)
    assert matcher.push("\nline two") == ("", True)


def test_stop_matcher_flush_releases_held_text():
    matcher = StopMatcher(["END"])
    assert matcher.push("the EN") == ("the ", False)
    assert matcher.flush() == "EN"


@pytest.mark.parametrize(
    ("text", "stop"),
    [
        ("The answer is 42. The end.", " The end"),
        ("Bonjour, ça va très bien 😀 merci", "😀 mer"),
        ("我爱自然语言处理。然后", "语言处"),
    ],
)
def test_stop_sequence_spanning_tokens(tokenizer, text, stop):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ts = TextStream(tokenizer, [stop])
    shown = []
    for i in ids:
        piece, matched = ts.push(i)
        shown.append(piece)
        if matched:
            break
    else:
        piece, matched = ts.finish()
        shown.append(piece)
    assert matched
    assert "".join(shown) == text[: text.index(stop)]
    # No chunk ever showed the start of the stop sequence.
    emitted = ""
    for piece in shown:
        emitted += piece
        assert stop not in emitted


# -- the O(1) detokenizer and its fallback: the same text as the full decode ------------------

DETOKENIZERS = {"stream": Detokenizer, "offsets": OffsetDetokenizer}


def whole(make, tokenizer, ids):
    """What a detokenizer made by ``make`` emits for ``ids``, pushes then flush."""
    detok = make(tokenizer)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    return pieces


def full_decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def token_ids(tokenizer):
    """Random id sequences: any id, the byte-level ones (the first ~300, split characters), and the special ones."""
    special = sorted(set(tokenizer.all_special_ids))
    any_id = st.integers(0, len(tokenizer) - 1)
    return st.lists(st.one_of(any_id, st.integers(0, 300), st.sampled_from(special)), max_size=48)


@pytest.mark.parametrize("kind", DETOKENIZERS)
def test_random_ids_stream_exactly(tokenizer, kind):
    make = DETOKENIZERS[kind]

    @settings(max_examples=300, deadline=None)
    @given(token_ids(tokenizer))
    def check(ids):
        pieces = whole(make, tokenizer, ids)
        full = full_decode(tokenizer, ids)
        assert "".join(pieces) == full
        if "\ufffd" not in full:
            assert all("\ufffd" not in p for p in pieces)

    check()


@pytest.mark.parametrize("kind", DETOKENIZERS)
def test_real_text_streams_exactly_with_special_tokens(tokenizer, kind):
    """Real text (the samples, a chat turn with its special tokens), cut at every length."""
    texts = [*SAMPLES, tokenizer.apply_chat_template([{"role": "user", "content": SAMPLES[1]}], tokenize=False)]
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for end in range(len(ids) + 1):
            cut = ids[:end]
            assert "".join(whole(DETOKENIZERS[kind], tokenizer, cut)) == full_decode(tokenizer, cut)


def test_the_stream_detokenizer_gives_the_same_text_pushed_from_two_threads(tokenizer):
    """Through ``SharedTokenizer`` (the engines'), pushed from two threads in turn (a resumed stream
    is replayed where it is submitted, then read on the engine's thread): the same text."""
    import threading

    shared = SharedTokenizer(tokenizer)
    ids = tokenizer(SAMPLES[1] + SAMPLES[2], add_special_tokens=False)["input_ids"]
    detok = Detokenizer(shared)
    pieces = [detok.push(i) for i in ids[:7]]
    other = threading.Thread(target=lambda: pieces.extend(detok.push(i) for i in ids[7:]))
    other.start()
    other.join()
    pieces.append(detok.flush())
    assert "".join(pieces) == full_decode(tokenizer, ids)


def transformers_encoding_only(tokenizer):
    """The same tokenizer as a class that encodes its own way (its ``_encode_plus`` overridden,
    as a model's own tokenizer class may): ``SharedTokenizer`` cannot know that the Rust
    tokenizer's own call gives its encoding, so it encodes through transformers on copies."""
    import copy

    kind = type(tokenizer)
    own = type("OwnEncoding", (kind,), {"_encode_plus": lambda self, *a, **k: kind._encode_plus(self, *a, **k)})
    other = copy.deepcopy(tokenizer)
    other.__class__ = own
    return other


@pytest.mark.parametrize("how", ["rust", "copies"])
def test_threads_decode_and_encode_at_once_with_no_borrow_error(tokenizer, how):
    """Decoding (a stream's ``Detokenizer``, ``decode``, ``token_text``) reads the original's Rust
    tokenizer from every thread at once and makes no copy. Encoding reads it too where its Rust
    call is the tokenizer's own encoding (the default model's), and takes the thread's own copy
    elsewhere. Eight threads at once, four of each, many rounds: every answer is a lone call's,
    none fails "Already borrowed", and only encoding through transformers makes copies."""
    import concurrent.futures
    import threading

    from tokenwire_server.domain import TextPrompt
    from tokenwire_server.text import PromptEncoder

    if how == "copies":
        tokenizer = transformers_encoding_only(tokenizer)
    shared = SharedTokenizer(tokenizer)
    assert (shared._rust is not None) == (how == "rust")
    encoder = PromptEncoder(shared)
    texts = [SAMPLES[i % len(SAMPLES)] * 8 for i in range(4)]
    expected_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    expected_text = [full_decode(tokenizer, ids) for ids in expected_ids]
    copies: dict[str, bool] = {}
    start = threading.Barrier(8)

    def decodes(i: int) -> bool:
        start.wait()
        ok = True
        for _ in range(15):
            ids = expected_ids[i]
            detok = Detokenizer(shared)
            streamed = "".join(detok.push(t) for t in ids) + detok.flush()
            ok &= streamed == expected_text[i] and shared.decode(ids, skip_special_tokens=True) == tokenizer.decode(
                ids, skip_special_tokens=True
            )
            ok &= [shared.token_text(t) for t in ids[:5]] == [
                tokenizer.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False) for t in ids[:5]
            ]
        copies[f"decode-{i}"] = getattr(shared._copies, "tokenizer", None) is not None
        return ok

    def encodes(i: int) -> bool:
        start.wait()
        ok = True
        for _ in range(15):
            ok &= encoder.encode(TextPrompt(texts[i])).ids == tokenizer(texts[i])["input_ids"]
            ok &= encoder.encode(TextPrompt(texts[i]), max_tokens=5).truncated
        copies[f"encode-{i}"] = getattr(shared._copies, "tokenizer", None) is not None
        return ok

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(decodes, i) for i in range(4)] + [pool.submit(encodes, i) for i in range(4)]
        assert [f.result(timeout=120) for f in futures] == [True] * 8
    assert copies == {**{f"decode-{i}": False for i in range(4)}, **{f"encode-{i}": how == "copies" for i in range(4)}}


def test_the_rust_call_encodes_as_the_tokenizer_does(tokenizer):
    """``SharedTokenizer.encode_text`` on the Rust tokenizer gives the ids and character spans
    of the tokenizer's own call, with and without its special tokens, special tokens written in
    the text included, and cuts a longer encoding at ``limit``; set truncation on the Rust
    tokenizer (someone else's state) and it encodes on a copy instead, with the same answers."""
    import copy

    shared = SharedTokenizer(tokenizer)
    assert shared._rust is tokenizer.backend_tokenizer
    texts = [*SAMPLES, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "", " ", "a" * 3000]
    for text in texts:
        for special in (False, True):
            theirs = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
            ids, spans = shared.encode_text(text, add_special_tokens=special, offsets=True)
            assert ids == theirs["input_ids"] and spans == [tuple(s) for s in theirs["offset_mapping"]], text
            assert shared.encode_text(text, add_special_tokens=special, limit=3)[0] == theirs["input_ids"][:3]
    assert getattr(shared._copies, "tokenizer", None) is None
    other = SharedTokenizer(copy.deepcopy(tokenizer))
    other._original.backend_tokenizer.enable_truncation(max_length=4)
    text = SAMPLES[0]
    assert (
        other.encode_text(text, add_special_tokens=False)[0] == tokenizer(text, add_special_tokens=False)["input_ids"]
    )
    assert getattr(other._copies, "tokenizer", None) is not None


def test_token_text_is_the_single_token_decode_kept(tokenizer):
    """``SharedTokenizer.token_text`` (TokenInfo's text) is the token's own decode, special tokens shown."""
    shared = SharedTokenizer(tokenizer)
    ids = [*tokenizer(SAMPLES[1], add_special_tokens=False)["input_ids"], *tokenizer.all_special_ids]
    for _ in range(2):  # decoded, then from the cache
        assert [shared.token_text(i) for i in ids] == [
            tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False) for i in ids
        ]


def test_a_tokenizer_without_a_rust_backend_falls_back_to_offsets(tokenizer):
    class DecodeOnly:
        def decode(self, ids, **kwargs):
            return tokenizer.decode(ids, **kwargs)

    ids = tokenizer(SAMPLES[1], add_special_tokens=False)["input_ids"]
    detok = Detokenizer(DecodeOnly())
    pieces = [detok.push(i) for i in ids[:-1]]
    assert "".join(pieces) + detok.flush() == full_decode(tokenizer, ids[:-1])
    assert detok.ids == ids[:-1]
