"""The reasoning parser's interface and its one state machine: a reply, fed piece by piece,
split into the model's thinking (between ``start`` and ``end``, e.g. ``<think>``/``</think>``)
and the content after it.

What a reply is made of, for every parser here (vLLM's ``Qwen3ReasoningParser`` and
``DeepSeekR1ReasoningParser`` give the same two texts for the same reply)::

    reply   = [whitespace] start  reasoning  [end content]     opened by the reply
            |            reasoning  [end content]              already open (see below)
            | content                                          no thinking at all

* The thinking is *already open* when the reply starts inside it: the prompt opened it
  (``in_reasoning=True``: the chat template wrote ``<think>`` into the generation prompt), or
  the parser always starts there (``deepseek_r1``). A reply that still writes the start
  marker first has it dropped, with the whitespace before it.
* Only a *leading* start marker opens the thinking: a reply that starts with content keeps a
  later ``<think>`` as content, verbatim. Inside the thinking, the first end marker closes it;
  everything after it is content, markers included.
* A reply that never closes its thinking (cut by ``max_tokens``) is all reasoning.
* Whitespace around the markers is kept as written (as vLLM keeps it): for
  ``<think>\\nhmm\\n</think>\\n\\nHi`` the reasoning is ``"\\nhmm\\n"`` and the content
  ``"\\n\\nHi"``. A caller that shows them may strip them.

Streaming: :meth:`ReasoningParser.feed` takes the reply in any pieces (characters, tokens'
texts, many tokens at once) and returns what is known so far; a piece that may be the
beginning of a marker is held back, never leaked into either text, until the next piece or
:meth:`ReasoningParser.finish` tells. The concatenated deltas equal :func:`parse_reasoning`'s
texts for every split of the same reply.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

__all__ = ["ReasoningDelta", "ReasoningParser", "parse_reasoning"]


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """The new reasoning and content text of one piece of a reply (either may be empty)."""

    reasoning: str = ""
    content: str = ""


class _Phase(enum.Enum):
    LEAD = "lead"  # nothing but whitespace and a partial start marker seen yet
    REASONING = "reasoning"
    CONTENT = "content"


class ReasoningParser(ABC):
    """Splits one reply into reasoning and content (module docstring: the rules), as it streams.

    A parser serves one reply: construct it with ``in_reasoning`` (whether the prompt left the
    reply inside the thinking: :meth:`prompt_opens_reasoning` of the rendered prompt), call
    :meth:`feed` with each new piece of text, then :meth:`finish` once, when the reply ends.

    Invariant: the text held back (not yet in any delta) is whitespace plus a proper prefix of
    ``start`` while the phase is LEAD, a proper prefix of ``end`` while it is REASONING, and
    nothing once it is CONTENT.
    """

    start: ClassVar[str]
    end: ClassVar[str]

    def __init__(self, *, in_reasoning: bool) -> None:
        self.in_reasoning = in_reasoning
        self._inside_at_start = self.reply_starts_in_reasoning(in_reasoning)
        self._phase = _Phase.LEAD
        self._held = ""
        self._has_reasoning = self._inside_at_start
        self._finished = False

    @classmethod
    @abstractmethod
    def reply_starts_in_reasoning(cls, in_reasoning: bool) -> bool:
        """Whether a reply starts inside the thinking, before any marker of its own, given
        whether the prompt opened it."""

    @classmethod
    def prompt_opens_reasoning(cls, prompt: str) -> bool:
        """Whether the rendered ``prompt`` leaves the reply inside an open thinking block: its
        last start marker is followed by nothing but whitespace (``...assistant\\n<think>\\n``).
        A prompt that closes it again (Qwen3's ``enable_thinking=False``:
        ``<think>\\n\\n</think>\\n\\n``) or only mentions the marker earlier does not; neither
        does one that continues reasoning text after the marker (a prefilled thinking)."""
        i = prompt.rfind(cls.start)
        return i >= 0 and not prompt[i + len(cls.start) :].strip()

    @property
    def has_reasoning(self) -> bool:
        """Whether the reply has a thinking block (so far): it started inside one, or opened
        one with a leading start marker."""
        return self._has_reasoning

    def feed(self, text: str) -> ReasoningDelta:
        """The reasoning and content that the reply's next piece ``text`` makes known."""
        assert not self._finished, "a reasoning parser fed after finish()"
        buf = self._held + text
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._phase is _Phase.LEAD:
                stripped = buf.lstrip()
                if stripped.startswith(self.start):
                    self._phase = _Phase.REASONING
                    self._has_reasoning = True
                    buf = stripped[len(self.start) :]
                    continue
                if self.start.startswith(stripped):  # whitespace, maybe a marker's beginning
                    self._held = buf
                    break
                self._phase = _Phase.REASONING if self._inside_at_start else _Phase.CONTENT
                continue
            if self._phase is _Phase.REASONING:
                i = buf.find(self.end)
                if i >= 0:
                    reasoning.append(buf[:i])
                    buf = buf[i + len(self.end) :]
                    self._phase = _Phase.CONTENT
                    continue
                keep = _partial_suffix(buf, self.end)
                reasoning.append(buf[: len(buf) - keep])
                self._held = buf[len(buf) - keep :]
                break
            content.append(buf)
            self._held = ""
            break
        return ReasoningDelta(reasoning="".join(reasoning), content="".join(content))

    def finish(self) -> ReasoningDelta:
        """The reply ended: what was held back, as the text it turned out to be (a partial
        marker is ordinary text of the phase it is in)."""
        assert not self._finished, "finish() called twice"
        self._finished = True
        held, self._held = self._held, ""
        if self._phase is _Phase.CONTENT or not held:
            return ReasoningDelta()
        if self._phase is _Phase.REASONING or self._inside_at_start:
            return ReasoningDelta(reasoning=held)
        return ReasoningDelta(content=held)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parse_reasoning(parser: ReasoningParser, text: str) -> tuple[str | None, str]:
    """A whole reply's (reasoning, content), with a fresh ``parser`` (it is used up): the
    reasoning is None when the reply has no thinking block at all (an empty string when it
    has an empty one)."""
    first = parser.feed(text)
    last = parser.finish()
    reasoning = first.reasoning + last.reasoning
    return (reasoning if parser.has_reasoning else None), first.content + last.content
