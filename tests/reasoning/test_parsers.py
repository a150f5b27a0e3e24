"""The reasoning parsers: for any reply and any split of it into deltas, the streamed texts
equal the whole reply's parse, which equals a plain reference reading of the rules
(``reasoning/parser.py``'s docstring); markers never leak into either text."""

from __future__ import annotations

import itertools

import jinja2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncpaged.errors import InvalidRequestError
from asyncpaged.reasoning import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningDelta,
    ReasoningParser,
    get_reasoning_parser,
    parse_reasoning,
    reasoning_parser_for_template,
    reasoning_parser_names,
    register_reasoning_parser,
)

PARSERS: tuple[type[ReasoningParser], ...] = (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)

# text near the markers: their pieces, whitespace, unicode (combining marks, astral, CJK)
_ALPHABET = st.sampled_from(
    ["<", "/", ">", "t", "h", "i", "n", "k", "a", " ", "\n", "\t", "é", "\u0301", "中", "😀",
     "<thin", "</think", "<think", "think>", "</", "\u3000"]
)  # fmt: skip
_TEXT = (
    st.lists(_ALPHABET, max_size=12)
    .map("".join)
    .filter(lambda s: "<think>" not in s and "</think>" not in s)
)
_SPACE = st.text(alphabet=" \n\t", max_size=3)


def reference(cls: type[ReasoningParser], in_reasoning: bool, reply: str) -> tuple[str | None, str]:
    """The rules, read off the whole reply at once."""
    stripped = reply.lstrip()
    if stripped.startswith(cls.start):
        body = stripped[len(cls.start) :]
    elif cls.reply_starts_in_reasoning(in_reasoning):
        body = reply
    else:
        return None, reply
    reasoning, _, content = body.partition(cls.end)
    return reasoning, content


@st.composite
def replies(draw: st.DrawFn) -> tuple[str, str, str, str]:
    """(reply, its reasoning part, its content part, its shape): one of the shapes a reply
    takes (``parser.py``'s docstring)."""
    reasoning, content = draw(_TEXT), draw(_TEXT)
    shape = draw(st.sampled_from(["opened", "open", "unclosed", "opened-unclosed", "content"]))
    lead = draw(_SPACE)
    match shape:
        case "opened":
            reply = f"{lead}<think>{reasoning}</think>{content}"
        case "open":
            reply = f"{reasoning}</think>{content}"
        case "unclosed":
            reply, content = reasoning, ""
        case "opened-unclosed":
            reply, content = f"{lead}<think>{reasoning}", ""
        case _:
            reply, reasoning = content, ""
    return reply, reasoning, content, shape


@st.composite
def splits(draw: st.DrawFn, text: str) -> list[str]:
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def streamed(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)


@given(data=st.data(), shaped=replies(), cls=st.sampled_from(PARSERS), in_reasoning=st.booleans())
def test_stream_equals_parse_equals_reference(
    data: st.DataObject,
    shaped: tuple[str, str, str, str],
    cls: type[ReasoningParser],
    in_reasoning: bool,
) -> None:
    reply = shaped[0]
    whole = parse_reasoning(cls(in_reasoning=in_reasoning), reply)
    assert whole == reference(cls, in_reasoning, reply)
    pieces = data.draw(splits(reply))
    parser = cls(in_reasoning=in_reasoning)
    reasoning, content = streamed(parser, pieces)
    assert (reasoning, content) == (whole[0] or "", whole[1])
    assert parser.has_reasoning == (whole[0] is not None)


@given(shaped=replies(), in_reasoning=st.booleans())
def test_replies_split_into_their_parts(
    shaped: tuple[str, str, str, str], in_reasoning: bool
) -> None:
    """Each shape of reply gives back the reasoning and content it was made of (one character
    at a time), and no marker it consumed; a reply the parser reads as content, verbatim."""
    reply, reasoning, content, shape = shaped
    for cls in PARSERS:
        inside = cls.reply_starts_in_reasoning(in_reasoning)
        parser = cls(in_reasoning=in_reasoning)
        got = streamed(parser, list(reply))
        if shape.startswith("opened") or (inside and shape in ("open", "unclosed")):
            assert got == (reasoning, content)
        elif shape == "content":
            assert got == ((content, "") if inside else ("", content))
        else:  # the reply closes a thinking that nothing opened: all content
            assert got == ("", reply)
            continue
        for text in got:
            assert "<think>" not in text and "</think>" not in text


def test_examples_match_vllm() -> None:
    """vLLM's parsers on the same replies: newlines around the markers are kept."""
    qwen = Qwen3ReasoningParser
    r1 = DeepSeekR1ReasoningParser
    assert parse_reasoning(qwen(in_reasoning=False), "<think>\nhmm\n</think>\n\nHi") == (
        "\nhmm\n", "\n\nHi",
    )  # fmt: skip
    assert parse_reasoning(qwen(in_reasoning=True), "hmm\n</think>\n\nHi") == ("hmm\n", "\n\nHi")
    assert parse_reasoning(qwen(in_reasoning=False), "Hi") == (None, "Hi")
    assert parse_reasoning(qwen(in_reasoning=True), "still thinking") == ("still thinking", "")
    assert parse_reasoning(qwen(in_reasoning=False), "<think>cut") == ("cut", "")
    # only a leading <think> opens the thinking
    assert parse_reasoning(qwen(in_reasoning=False), "Hi <think>x</think>") == (
        None, "Hi <think>x</think>",
    )  # fmt: skip
    # after the thinking, markers are content
    assert parse_reasoning(qwen(in_reasoning=False), "<think>a</think>b<think>c") == (
        "a",
        "b<think>c",
    )
    # DeepSeek-R1: always inside the thinking; a leading <think> (R1-0528) dropped
    for in_reasoning in (False, True):
        assert parse_reasoning(r1(in_reasoning=in_reasoning), "abc") == ("abc", "")
        assert parse_reasoning(r1(in_reasoning=in_reasoning), "a</think>b") == ("a", "b")
        assert parse_reasoning(r1(in_reasoning=in_reasoning), "<think>\na</think>b") == ("\na", "b")
    assert parse_reasoning(r1(in_reasoning=True), "") == ("", "")
    assert parse_reasoning(qwen(in_reasoning=False), "") == (None, "")


def test_a_partial_marker_is_held_back_until_it_is_known() -> None:
    parser = Qwen3ReasoningParser(in_reasoning=False)
    assert parser.feed("\n<thi") == ReasoningDelta()
    assert parser.feed("nk>abc</th") == ReasoningDelta(reasoning="abc")
    assert parser.feed("ank") == ReasoningDelta(reasoning="</thank")
    assert parser.feed("</") == ReasoningDelta()
    assert parser.finish() == ReasoningDelta(reasoning="</")
    parser = Qwen3ReasoningParser(in_reasoning=False)
    assert parser.feed(" <th") == ReasoningDelta()
    assert parser.feed("e") == ReasoningDelta(content=" <the")
    parser = Qwen3ReasoningParser(in_reasoning=False)
    assert parser.feed("<thin") == ReasoningDelta()
    assert parser.finish() == ReasoningDelta(content="<thin")
    assert not parser.has_reasoning


# The generation-prompt parts of real templates (Jinja source as in tokenizer_config.json,
# after JSON decoding), with the history turn of Qwen3's that writes a closed thinking block.
QWEN3_HYBRID = (
    "{%- for message in messages %}{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + message.reasoning_content "
    "+ '\\n</think>\\n\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
QWEN3_THINKING_2507 = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content "
    "+ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
    "{#- replies close it: </think> #}"
)
DEEPSEEK_R1 = (
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{'<｜User｜>' + message['content']}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"
    "{#- the reply's </think> is cut from history #}"
)


def render(template: str, **kwargs: object) -> str:
    messages = [
        {"role": "user", "content": "What is <think>?"},
        {"role": "assistant", "content": "A tag.", "reasoning_content": "hmm"},
        {"role": "user", "content": "And 2 + 2?"},
    ]
    env = jinja2.Environment()
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, **kwargs)


def test_prompt_opens_reasoning_on_rendered_templates() -> None:
    qwen, r1 = Qwen3ReasoningParser, DeepSeekR1ReasoningParser
    assert not qwen.prompt_opens_reasoning(render(QWEN3_HYBRID))  # the model opens it
    off = render(QWEN3_HYBRID, enable_thinking=False)
    assert off.endswith("<think>\n\n</think>\n\n") and not qwen.prompt_opens_reasoning(off)
    opened = render(QWEN3_THINKING_2507)
    assert opened.endswith("assistant\n<think>\n") and qwen.prompt_opens_reasoning(opened)
    r1_prompt = render(DEEPSEEK_R1)
    assert r1_prompt.endswith("<｜Assistant｜><think>\n") and r1.prompt_opens_reasoning(r1_prompt)
    # a marker mentioned earlier, or reasoning prefilled after it, leaves it closed
    assert not qwen.prompt_opens_reasoning("<|im_start|>user\nWhat is <think>?<|im_end|>\n")
    assert not qwen.prompt_opens_reasoning("<think>\nso far")
    assert qwen.prompt_opens_reasoning("<think>") and not qwen.prompt_opens_reasoning("")


def test_reasoning_parser_for_template() -> None:
    assert reasoning_parser_for_template(QWEN3_HYBRID) == "qwen3"
    assert reasoning_parser_for_template(QWEN3_THINKING_2507) == "deepseek_r1"
    assert reasoning_parser_for_template(DEEPSEEK_R1) == "deepseek_r1"
    assert reasoning_parser_for_template("{{ messages[0].content }}") is None
    assert reasoning_parser_for_template(None) is None
    assert reasoning_parser_for_template("<think> only") is None


def test_registry() -> None:
    assert {"qwen3", "deepseek_r1"} <= set(reasoning_parser_names())
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    with pytest.raises(
        InvalidRequestError, match=r"unknown reasoning parser 'nope'; known: .*qwen3"
    ):
        get_reasoning_parser("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_reasoning_parser("qwen3")(DeepSeekR1ReasoningParser)
    with pytest.raises(ValueError, match="non-empty"):
        register_reasoning_parser("")
    with pytest.raises(TypeError):
        ReasoningParser(in_reasoning=False)  # type: ignore[abstract]
