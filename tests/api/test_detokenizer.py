"""IncrementalDetokenizer and check_stop_token, on tokenizers built in-process (no downloads).

Oracles are the tokenizer's own ``decode`` and plain ``str`` operations on the source text, never
the detokenizer's output. Three tokenizers:

* ``byte_bpe()``: a byte-level BPE (GPT-2 style) trained here on multilingual text, wrapped in
  ``PreTrainedTokenizerFast``; many tokens start or end in the middle of a UTF-8 character.
* ``byte_slow()``: a Python ("slow") byte tokenizer subclassing ``PreTrainedTokenizer``; ASCII
  byte ``b`` is token id ``b``, which makes hand-built cases easy.
* ``word_level()``: a WordLevel fast tokenizer without decoder (tokens are joined with spaces).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from asyncpaged.detokenizer import IncrementalDetokenizer, check_stop_token
from asyncpaged.sampling_params import SamplingParams

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Héllo wörld! Café naïve résumé, señor, crème brûlée.",
    "你好世界，我很好。今天天气很好。",
    "こんにちは世界、ありがとう。",
    "Emoji: 🙂 🎉 👍🏽 🚀 ❤️ 👨‍👩‍👧",
    "Ελληνικά και русский текст.",
    "stop here STOP there\nnew line\ttab",
]
CORPUS_CHARS = sorted(set("".join(CORPUS)))


@functools.cache
def byte_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>"
    )
    fast.add_tokens(["<sep>"])  # an added, non-special token
    return fast


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


BYTE_TO_CHAR = _bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


def _piece(data: bytes) -> str:
    return "".join(BYTE_TO_CHAR[b] for b in data)


class ByteTokenizer(PreTrainedTokenizer):
    """Slow byte-level tokenizer: ids 0-255 are the bytes, then a few multi-byte pieces."""

    MERGED = (
        "你".encode(),
        "é".encode(),
        b" the",
        "你".encode()[:2],
        "é".encode()[1:] + b"x",
        b"b" + "你".encode()[:1],
    )

    def __init__(self, **kwargs: Any) -> None:
        pieces = [_piece(bytes([b])) for b in range(256)] + [_piece(m) for m in self.MERGED]
        self._piece_to_id = {p: i for i, p in enumerate(pieces)}
        self._id_to_piece = dict(enumerate(pieces))
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return len(self._piece_to_id)

    def get_vocab(self) -> dict[str, int]:
        return {**self._piece_to_id, **self.added_tokens_encoder}

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        chars, out, i = _piece(text.encode()), [], 0
        while i < len(chars):  # greedy longest match
            j = next(j for j in range(len(chars), i, -1) if chars[i:j] in self._piece_to_id)
            out.append(chars[i:j])
            i = j
        return out

    def _convert_token_to_id(self, token: str) -> int:
        return self._piece_to_id[token]

    def _convert_id_to_token(self, index: int) -> str:
        return self._id_to_piece[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        data = bytes(CHAR_TO_BYTE[c] for token in tokens for c in token)
        return data.decode("utf-8", errors="replace")


@functools.cache
def byte_slow() -> ByteTokenizer:
    return ByteTokenizer(bos_token="<s>", eos_token="</s>")


WORDS = ["[UNK]", "hello", "world", ".", "<eos>", "foo", "bar", ","]


@functools.cache
def word_level() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="[UNK]")


@functools.cache
def sentencepiece_like() -> PreTrainedTokenizerFast:
    """Llama 2 / Mistral style: "▁" for spaces, <0xNN> byte fallback, one leading space stripped."""
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizer
    trainer = trainers.BpeTrainer(
        vocab_size=160, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    trained.train_from_iterator(CORPUS * 3, trainer)
    model = json.loads(trained.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.normalizer = normalizer
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@functools.cache
def wordpiece_like() -> PreTrainedTokenizerFast:
    """BERT-style decoding: "##" pieces attach, other tokens get a space, and the decoder's
    cleanup (" ." -> ".", " n't" -> "n't", " ' " -> "'") runs on each token."""
    words = [*WORDS, "##s", "##ing", "'", "n't", "do", "not", "?", "##", "'s"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="[UNK]")
    fast.add_tokens(["<sep>"])  # an added, non-special token
    return fast


BYTE_TOKENIZERS = {"fast_bpe": byte_bpe, "slow_bytes": byte_slow}


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text, "test tokenizer must round-trip its input"
    return list(ids)


def _decode(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], **kwargs: Any) -> str:
    text = tokenizer.decode(list(ids), **kwargs)
    assert isinstance(text, str)
    return text


def _stream(
    detok: IncrementalDetokenizer, ids: Sequence[int], chunk_sizes: Sequence[int] = (1,)
) -> list[str]:
    """Feed ids in chunks (sizes cycling); finish; return every delta (finish's last)."""
    deltas: list[str] = []
    pos, k = 0, 0
    while pos < len(ids) and not detok.finished:
        size = chunk_sizes[k % len(chunk_sizes)]
        deltas.append(detok.update(ids[pos : pos + size]))
        assert "".join(deltas) == detok.output_text
        pos, k = pos + size, k + 1
    deltas.append(detok.finish())
    return deltas


texts = st.text(
    st.one_of(
        st.sampled_from(CORPUS_CHARS),
        st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters="\ufffd"),
    ),
    max_size=40,
)
chunkings = st.lists(st.integers(1, 4), min_size=1, max_size=5)


@given(data=st.data(), name=st.sampled_from(sorted(BYTE_TOKENIZERS)), skip=st.booleans())
def test_random_ids_decode_like_the_tokenizer(data: st.DataObject, name: str, skip: bool) -> None:
    tokenizer = BYTE_TOKENIZERS[name]()
    token_id = st.integers(0, len(tokenizer) - 1)
    prompt = data.draw(st.lists(token_id, max_size=8), label="prompt")
    output = data.draw(st.lists(token_id, max_size=30), label="output")
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(skip_special_tokens=skip))
    deltas = _stream(detok, output, data.draw(chunkings, label="chunks"))
    expected = _decode(tokenizer, output, skip_special_tokens=skip)
    assert "".join(deltas) == expected
    assert detok.output_text == expected
    assert detok.output_token_ids == output
    assert detok.stop_reason is None


@given(data=st.data(), name=st.sampled_from(sorted(BYTE_TOKENIZERS)), text=texts)
def test_multibyte_characters_never_stream_partially(
    data: st.DataObject, name: str, text: str
) -> None:
    tokenizer = BYTE_TOKENIZERS[name]()
    prompt = _encode(tokenizer, data.draw(texts, label="prompt text"))
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    deltas = _stream(detok, _encode(tokenizer, text), data.draw(chunkings, label="chunks"))
    assert not any("\ufffd" in delta for delta in deltas)
    assert "".join(deltas) == text


def test_partial_character_is_held_until_complete() -> None:
    tokenizer = byte_bpe()
    ids = _encode(tokenizer, "naïve")
    pieces = [_decode(tokenizer, [i]) for i in ids]
    split = next(k for k, p in enumerate(pieces) if p.endswith("\ufffd"))  # "na" + half of ï
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    assert "".join(detok.update([i]) for i in ids[: split + 1]) == ""
    assert "".join(detok.update([i]) for i in ids[split + 1 :]) + detok.finish() == "naïve"


def test_finish_renders_an_incomplete_character_like_decode() -> None:
    tokenizer = byte_slow()
    ids = ["你".encode()[0], "你".encode()[1]]  # two of three bytes
    detok = IncrementalDetokenizer(tokenizer, list(b"ab"), SamplingParams())
    assert detok.update(ids) == ""
    tail = detok.finish()
    assert tail == _decode(tokenizer, ids)
    assert "\ufffd" in tail


def test_prompt_ending_mid_character() -> None:
    tokenizer = byte_slow()
    ni = list("你".encode())
    detok = IncrementalDetokenizer(tokenizer, [*b"xy", ni[0], ni[1]], SamplingParams())
    output = [ni[2], *b"ok"]
    assert "".join(_stream(detok, output)) == _decode(tokenizer, output) == "\ufffdok"


def test_out_of_vocabulary_ids_add_no_text() -> None:
    tokenizer = byte_slow()
    output = [*b"ab", len(tokenizer), 10**6, *b"c"]
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    assert "".join(_stream(detok, output)) == "abc"
    assert detok.output_token_ids == output


def test_special_tokens_follow_skip_special_tokens() -> None:
    tokenizer = byte_bpe()
    eos = tokenizer.eos_token_id
    sep = tokenizer.convert_tokens_to_ids("<sep>")
    assert isinstance(eos, int)
    assert isinstance(sep, int)
    output = [*_encode(tokenizer, "ab"), eos, sep, *_encode(tokenizer, "c")]
    for skip, expected in [(True, "ab<sep>c"), (False, "ab<|endoftext|><sep>c")]:
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=skip))
        assert "".join(_stream(detok, output)) == expected


@given(
    data=st.data(),
    prompt=st.lists(st.integers(0, len(WORDS) - 1), max_size=7),
    output=st.lists(st.integers(0, len(WORDS) - 1), max_size=15),
    skip=st.booleans(),
)
def test_word_level_text_continues_the_prompt(
    data: st.DataObject, prompt: list[int], output: list[int], skip: bool
) -> None:
    tokenizer = word_level()
    whole = _decode(tokenizer, prompt + output, skip_special_tokens=skip)
    prompt_text = _decode(tokenizer, prompt, skip_special_tokens=skip)
    assert whole.startswith(prompt_text)
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(skip_special_tokens=skip))
    deltas = _stream(detok, output, data.draw(chunkings))
    assert "".join(deltas) == whole[len(prompt_text) :]


def test_word_level_first_token_keeps_its_separator() -> None:
    """The documented difference from decode(output_ids): the joining space after the prompt."""
    tokenizer = word_level()
    prompt = _encode(tokenizer, "hello")
    output = _encode(tokenizer, "world .")
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    assert "".join(_stream(detok, output)) == " world ."
    assert _decode(tokenizer, output) == "world ."
    no_prompt = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    assert "".join(_stream(no_prompt, output)) == "world ."


@given(
    data=st.data(),
    prompt_text=texts,
    pieces=st.lists(texts, max_size=3),
    specials=st.lists(st.sampled_from(["<s>", "</s>", "<unk>"]), min_size=3, max_size=3),
    bos=st.booleans(),
    skip=st.booleans(),
)
def test_sentencepiece_like_text_continues_the_prompt(
    data: st.DataObject,
    prompt_text: str,
    pieces: list[str],
    specials: list[str],
    bos: bool,
    skip: bool,
) -> None:
    tokenizer = sentencepiece_like()
    prompt = [tokenizer.bos_token_id] * bos + _encode(tokenizer, prompt_text)
    output: list[int] = []
    for piece, special in zip(pieces, specials, strict=False):
        output += [*_encode(tokenizer, piece), tokenizer.convert_tokens_to_ids(special)]
    whole = _decode(tokenizer, prompt + output, skip_special_tokens=skip)
    prompt_decoded = _decode(tokenizer, prompt, skip_special_tokens=skip)
    assert whole.startswith(prompt_decoded)
    assert "\ufffd" not in whole
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(skip_special_tokens=skip))
    deltas = _stream(detok, output, data.draw(chunkings))
    assert "".join(deltas) == whole[len(prompt_decoded) :]
    assert not any("\ufffd" in delta for delta in deltas)


def test_sentencepiece_like_first_token_keeps_its_space() -> None:
    tokenizer = sentencepiece_like()
    prompt = _encode(tokenizer, "Hello")
    output = _encode(tokenizer, "wörld ☃")
    assert tokenizer.convert_ids_to_tokens(output)[0] == "▁", "precondition: a leading space"
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    assert "".join(_stream(detok, output)) == " wörld ☃"
    assert _decode(tokenizer, output) == "wörld ☃"  # decode strips the first space


def test_byte_fallback_invalid_run_is_the_documented_exception() -> None:
    """decode renders every <0xNN> token of an invalid run as U+FFFD, even a valid "z".

    The "z" was complete when it was generated and has been streamed; it cannot be taken back,
    so the final text keeps it where decode shows U+FFFD. This happens only for invalid UTF-8.
    """
    tokenizer = sentencepiece_like()
    z, cont = tokenizer.convert_tokens_to_ids(["<0x7A>", "<0xA7>"])
    assert _decode(tokenizer, [z, cont]) == "\ufffd\ufffd"
    detok = IncrementalDetokenizer(tokenizer, _encode(tokenizer, "Hi"), SamplingParams())
    assert detok.update([z]) == "z"
    assert detok.update([cont]) + detok.finish() == "\ufffd"
    assert detok.output_text == "z\ufffd"


def test_prompt_tail_starting_inside_a_byte_fallback_character() -> None:
    """The 5-id context would start inside ☃'s bytes, which decode renders as U+FFFD throughout;
    the detokenizer must reach back to the character's start and keep the prompt context."""
    tokenizer = sentencepiece_like()
    prompt = _encode(tokenizer, "☃☃")
    assert tokenizer.convert_ids_to_tokens(prompt[-5:])[0].startswith("<0x"), "precondition"
    assert _decode(tokenizer, prompt[-5:]).endswith("\ufffd"), "precondition"
    output = _encode(tokenizer, "ok")
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    assert "".join(_stream(detok, output)) == " ok"


def _expected_stop(text: str, stops: Sequence[str]) -> tuple[int, int, str] | None:
    """(end, start, stop) of the stop string completed first in ``text``; ties: longest."""
    found = [
        (text.index(s) + len(s), text.index(s), s) for s in stops if s in text
    ]  # first occurrence of each
    return min(found, key=lambda f: f[:2]) if found else None


@given(
    data=st.data(),
    name=st.sampled_from(sorted(BYTE_TOKENIZERS)),
    text=texts.filter(bool),
    include=st.booleans(),
)
def test_stop_strings(data: st.DataObject, name: str, text: str, include: bool) -> None:
    tokenizer = BYTE_TOKENIZERS[name]()
    start = data.draw(st.integers(0, len(text) - 1), label="stop start")
    end = data.draw(st.integers(start + 1, min(len(text), start + 6)), label="stop end")
    stops = [text[start:end], *data.draw(st.lists(texts.filter(bool), max_size=2), label="more")]
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    ids = _encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    deltas = _stream(detok, ids, data.draw(chunkings, label="chunks"))

    expected = _expected_stop(text, stops)
    assert expected is not None
    stop_end, stop_start, stop = expected
    final = text[:stop_end] if include else text[:stop_start]
    assert "".join(deltas) == final
    assert detok.stop_reason == stop
    assert detok.finished
    # Exactly the ids up to the one that completed the stop string were consumed.
    consumed = detok.output_token_ids
    assert consumed == ids[: len(consumed)]
    assert _decode(tokenizer, consumed).startswith(text[:stop_end])
    assert not _decode(tokenizer, consumed[:-1]).startswith(text[:stop_end])
    # Hold-back: no delta ever showed text that was cut afterwards.
    released = ""
    for delta in deltas:
        released += delta
        assert final.startswith(released)


def test_stop_string_starting_mid_token_ending_in_the_next() -> None:
    tokenizer = byte_bpe()
    text = "The quick brown fox"
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    ids, spans = enc["input_ids"], enc["offset_mapping"]
    stop = "uic"  # "q[u]" + "[ic]k" in the trained vocabulary
    at = text.index(stop)
    first = next(k for k, (a, b) in enumerate(spans) if a <= at < b)
    last = next(k for k, (a, b) in enumerate(spans) if a < at + len(stop) <= b)
    assert spans[first][0] < at, "precondition: the stop string starts mid-token"
    assert last == first + 1, "precondition: it ends in the next token"
    assert spans[last][1] > at + len(stop), "precondition: that token goes on after it"

    for include, final in [(False, "The q"), (True, "The quic")]:
        params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
        detok = IncrementalDetokenizer(tokenizer, [], params)
        released = "".join(detok.update([i]) for i in ids[:last])
        assert not detok.finished
        assert final.startswith(released)
        if not include:
            assert released == text[: spans[last][0] - 2], "holds back len(stop) - 1 chars"
        assert released + detok.update([ids[last]]) == final
        assert detok.finished
        assert detok.stop_reason == stop
        assert detok.output_token_ids == ids[: last + 1]


def test_stop_string_ending_in_a_split_character() -> None:
    tokenizer = byte_bpe()
    text = "Café naïve résumé"
    ids = _encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop="aï"))
    deltas = _stream(detok, ids)
    assert "".join(deltas) == "Café n"
    assert detok.stop_reason == "aï"
    assert not any("\ufffd" in d for d in deltas)


def test_holds_back_longest_stop_minus_one() -> None:
    tokenizer = byte_slow()
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["xyz", "q"]))
    assert [detok.update([b]) for b in b"abcxy"] == ["", "", "a", "b", "c"]
    assert detok.output_text == "abc"
    assert detok.finish() == "xy"
    assert detok.output_text == "abcxy"
    assert detok.stop_reason is None


def test_first_completed_stop_wins() -> None:
    tokenizer = byte_slow()
    # "bc" completes before "abcd" although "abcd" starts first.
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["abcd", "bc"]))
    assert "".join(_stream(detok, list(b"xabcdy"), [6])) == "xa"
    assert detok.stop_reason == "bc"
    # Two completed by the same character: the longer one (earlier start) wins.
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["c", "abc"]))
    assert "".join(_stream(detok, list(b"xabcd"), [5])) == "x"
    assert detok.stop_reason == "abc"


def test_stop_in_the_text_of_the_final_pending_ids() -> None:
    tokenizer = byte_slow()
    b_and_lead_byte = tokenizer.convert_tokens_to_ids(_piece(b"b" + "你".encode()[:1]))
    assert isinstance(b_and_lead_byte, int)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["b"]))
    assert detok.update([ord("a"), b_and_lead_byte]) == "a"  # "b\ufffd" stays pending
    assert detok.finish() == ""
    assert detok.stop_reason == "b"
    assert detok.output_text == "a"


def test_min_tokens_delays_stop_strings() -> None:
    tokenizer = byte_slow()
    params = SamplingParams(stop=["ab", "x"], min_tokens=3)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    # "x" at token 1 and "ab" ending at token 3 are within min_tokens; "ab" ending at 5 is not.
    assert "".join(_stream(detok, list(b"xababx"))) == "xab"
    assert detok.stop_reason == "ab"
    assert detok.output_token_ids == list(b"xabab")
    detok = IncrementalDetokenizer(tokenizer, [], params)
    assert "".join(_stream(detok, list(b"xab"))) == "xab"
    assert detok.stop_reason is None
    detok = IncrementalDetokenizer(tokenizer, [], params)
    # A stop string may start in the first min_tokens tokens and end after them.
    assert "".join(_stream(detok, list(b"ccabx"))) == "cc"
    assert detok.stop_reason == "ab"
    assert detok.output_token_ids == list(b"ccab")


@pytest.mark.parametrize(("include", "expected"), [(False, "ab"), (True, "ab\n")])
def test_stop_terminated_token(include: bool, expected: str) -> None:
    tokenizer = byte_slow()
    params = SamplingParams(stop_token_ids=[ord("\n")], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    assert detok.update(list(b"a")) == "a"
    assert detok.update(list(b"b\n"), stop_terminated=True) == expected[1:]
    assert detok.finished
    assert detok.output_text == expected
    assert detok.output_token_ids == list(b"ab\n")
    assert detok.stop_reason is None


def test_finished_detokenizer() -> None:
    detok = IncrementalDetokenizer(byte_slow(), [], SamplingParams(stop="b"))
    assert detok.update(list(b"abc")) == "a"
    assert detok.output_token_ids == list(b"ab")
    assert detok.finish() == ""
    with pytest.raises(AssertionError, match="finished"):
        detok.update([1])


class _StrictKwargsTokenizer(ByteTokenizer):
    """Refuses unknown decode options, as transformers' MistralCommonBackend does."""

    def _decode(
        self,
        token_ids: int | list[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
        **kwargs: Any,
    ) -> str:
        assert not kwargs, f"unexpected decode options {kwargs}"
        return super()._decode(token_ids, skip_special_tokens, clean_up_tokenization_spaces)


class _SpacesTokenizer(ByteTokenizer):
    """Declares spaces_between_special_tokens (like wav2vec2) and records it."""

    seen: list[bool]

    def _decode(
        self,
        token_ids: int | list[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
        spaces_between_special_tokens: bool = False,
        **kwargs: Any,
    ) -> str:
        self.seen.append(spaces_between_special_tokens)
        return super()._decode(token_ids, skip_special_tokens, clean_up_tokenization_spaces)


def test_decode_options_are_passed_only_where_declared() -> None:
    strict = _StrictKwargsTokenizer(eos_token="</s>")
    detok = IncrementalDetokenizer(strict, list(b"p"), SamplingParams())
    assert "".join(_stream(detok, list(b"ok"))) == "ok"

    spaces = _SpacesTokenizer(eos_token="</s>")
    for flag in (False, True):
        spaces.seen = []
        params = SamplingParams(spaces_between_special_tokens=flag)
        detok = IncrementalDetokenizer(spaces, list(b"p"), params)
        assert "".join(_stream(detok, list(b"ok"))) == "ok"
        assert spaces.seen
        assert set(spaces.seen) == {flag}


EOS = 2


@pytest.mark.parametrize(
    ("token_id", "kwargs", "num_generated", "expected"),
    [
        (EOS, {}, 1, ("stop", None)),
        (5, {}, 1, None),
        (EOS, {"ignore_eos": True}, 1, None),
        (7, {"stop_token_ids": [7, 9]}, 1, ("stop", 7)),
        (9, {"stop_token_ids": [7, 9], "ignore_eos": True}, 4, ("stop", 9)),
        (EOS, {"stop_token_ids": [EOS], "ignore_eos": True}, 1, ("stop", EOS)),
        # min_tokens=3: the first three tokens cannot stop; the fourth can.
        (EOS, {"min_tokens": 3}, 3, None),
        (EOS, {"min_tokens": 3}, 4, ("stop", None)),
        (7, {"min_tokens": 3, "stop_token_ids": [7]}, 2, None),
        (7, {"min_tokens": 3, "stop_token_ids": [7]}, 4, ("stop", 7)),
    ],
)
def test_check_stop_token(
    token_id: int, kwargs: dict[str, Any], num_generated: int, expected: object
) -> None:
    params = SamplingParams(**kwargs)
    assert check_stop_token(token_id, params, EOS, num_generated) == expected


def test_check_stop_token_without_eos() -> None:
    assert check_stop_token(0, SamplingParams(), None, 1) is None
    assert check_stop_token(0, SamplingParams(stop_token_ids=[0]), None, 1) == ("stop", 0)


def test_stock_fast_tokenizers_decode_through_their_backend_with_the_same_text() -> None:
    """A stock fast tokenizer is decoded through its Rust backend (transformers' wrapper
    skipped); a tokenizer that overrides ``_decode`` keeps the wrapper. The random-ids and
    stop-string properties above run the fast path through ``fast_bpe``."""
    fast = BYTE_TOKENIZERS["fast_bpe"]()
    for skip in (False, True):
        detok = IncrementalDetokenizer(fast, [1, 2], SamplingParams(skip_special_tokens=skip))
        assert detok._backend is fast.backend_tokenizer
        ids = list(range(len(fast)))
        assert detok._decode(ids) == _decode(fast, ids, skip_special_tokens=skip)
    spaces = _SpacesTokenizer(eos_token="</s>")
    spaces.seen = []
    for wrapped in (
        BYTE_TOKENIZERS["slow_bytes"](),
        _StrictKwargsTokenizer(eos_token="</s>"),
        spaces,
    ):
        assert IncrementalDetokenizer(wrapped, [1], SamplingParams())._backend is None


FAST_TOKENIZERS = {
    "fast_bpe": byte_bpe,
    "word_level": word_level,
    "wordpiece": wordpiece_like,
    "sentencepiece": sentencepiece_like,
}


@given(
    data=st.data(),
    name=st.sampled_from(sorted(FAST_TOKENIZERS)),
    skip=st.booleans(),
    chunks=chunkings,
)
def test_the_rust_decode_stream_gives_the_python_windows_text(
    data: st.DataObject, name: str, skip: bool, chunks: list[int]
) -> None:
    """A plain fast tokenizer's ids go through ``tokenizers``' DecodeStream, and a byte-level
    one's whole-character tokens through the table of their texts; the deltas, the final text
    and the stop-string cuts of either equal those of the Python window algorithm they stand
    in for, on random ids (split characters, byte-fallback runs, special, added and
    out-of-vocabulary ids) after a random prompt."""
    tokenizer = FAST_TOKENIZERS[name]()
    high = len(tokenizer) + 2  # a few ids past the vocabulary
    prompt = data.draw(st.lists(st.integers(0, high), max_size=10), label="prompt")
    ids = data.draw(st.lists(st.integers(0, high), max_size=40), label="ids")
    stop = data.draw(st.lists(st.sampled_from(["o", "lo w", ".", "a"]), max_size=2), label="stop")
    params = SamplingParams(skip_special_tokens=skip, stop=stop or None)
    fast = IncrementalDetokenizer(tokenizer, prompt, params)
    assert fast._streaming, "a plain fast tokenizer streams through Rust"
    assert (fast._whole is None) == (name == "sentencepiece"), "tokens alone where local"
    stream_only = IncrementalDetokenizer(tokenizer, prompt, params)
    stream_only._whole = None
    windows_and_table = IncrementalDetokenizer(tokenizer, prompt, params)
    windows_and_table._streaming, windows_and_table._stream = False, None
    slow = IncrementalDetokenizer(tokenizer, prompt, params)
    slow._streaming, slow._stream, slow._whole = False, None, None
    expected = _stream(slow, ids, chunks)
    assert _stream(fast, ids, chunks) == expected
    assert _stream(stream_only, ids, chunks) == expected
    assert _stream(windows_and_table, ids, chunks) == expected
    assert fast.output_text == slow.output_text and fast.stop_reason == slow.stop_reason


def test_whole_tokens_around_a_split_character() -> None:
    """Whole tokens take the table; a character split over tokens after them makes the Rust
    stream again at the table's offsets, and the text is the tokenizer's."""
    tokenizer = byte_bpe()
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=False))
    split = tokenizer.convert_tokens_to_ids([_piece(bytes([b])) for b in "你".encode()])
    pieces = [_encode(tokenizer, "ab"), list(split), _encode(tokenizer, "b.")]
    assert detok._whole is not None
    whole = [i for i in pieces[0] + pieces[2] if detok._whole.text(i)]
    assert whole, "the corpus's ASCII tokens are whole characters"
    assert detok._whole.text(pieces[1][0]) == "", "a lead byte alone is not"
    ids = [i for p in pieces for i in p] + [tokenizer.eos_token_id]
    deltas = _stream(detok, ids)
    assert "".join(deltas) == _decode(tokenizer, ids, skip_special_tokens=False)
    assert "".join(deltas) == "ab你b.<|endoftext|>"
    # The table is shared by both skip settings: special tokens stay out of it.
    skipping = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=True))
    assert "".join(_stream(skipping, ids)) == "ab你b."
