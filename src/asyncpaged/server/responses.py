"""OpenAI response bodies built from :class:`RequestOutput`: choices, chunks, logprobs, usage,
and the error body (``{"error": {"message", "type", "param", "code"}}``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncpaged.outputs import CompletionOutput, Logprob, RequestOutput, ToolCallDelta

__all__ = ["ChunkWriter", "chat_response", "completion_response", "error_body", "usage"]

_MIN_LOGPROB = -9999.0  # -inf is not JSON (vLLM clamps the same way)

JSON = dict[str, Any]


def error_body(message: str, *, type_: str = "invalid_request_error",
               param: str | None = None, code: str | None = None) -> JSON:  # fmt: skip
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(outputs: Sequence[RequestOutput]) -> JSON:
    """Prompt tokens once per prompt (``n`` choices share it), completion tokens of every
    choice, and the prompt tokens served from the prefix cache."""
    prompt = sum(len(o.prompt_token_ids or ()) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens or 0 for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _clamp(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def _text(token_id: int, entry: Logprob) -> str:
    return entry.decoded_token if entry.decoded_token is not None else f"token_id:{token_id}"


def _top(position: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The ``k`` most likely tokens at a position, most likely first."""
    ranked = [(t, e) for t, e in position.items() if e.rank is not None and e.rank <= k]
    return sorted(ranked, key=lambda item: item[1].rank or 0)


def completion_logprobs(completion: CompletionOutput, k: int, text_offset: int) -> JSON | None:
    """The legacy completions ``logprobs`` object, its ``text_offset`` starting at
    ``text_offset``; the top dicts hold the ``k`` most likely tokens and the sampled one."""
    if completion.logprobs is None:
        return None
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, position in zip(completion.token_ids, completion.logprobs, strict=False):
        entry = position[token_id]
        text = _text(token_id, entry)
        tokens.append(text)
        token_logprobs.append(_clamp(entry.logprob))
        top = {_text(t, e): _clamp(e.logprob) for t, e in _top(position, k)}
        top.setdefault(text, _clamp(entry.logprob))
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}  # fmt: skip


def chat_logprobs(completion: CompletionOutput, k: int) -> JSON | None:
    """The chat ``logprobs`` object: ``content`` with each token and its ``k`` alternatives."""
    if completion.logprobs is None:
        return None
    content = []
    for token_id, position in zip(completion.token_ids, completion.logprobs, strict=False):
        entry = position[token_id]
        text = _text(token_id, entry)
        content.append({
            "token": text, "logprob": _clamp(entry.logprob), "bytes": list(text.encode()),
            "top_logprobs": [
                {"token": _text(t, e), "logprob": _clamp(e.logprob),
                 "bytes": list(_text(t, e).encode())}
                for t, e in _top(position, k)
            ],
        })  # fmt: skip
    return {"content": content}


def completion_response(rid: str, model: str, outputs: Sequence[RequestOutput], k: int,
                        echo: Sequence[str] | None) -> JSON:  # fmt: skip
    """A non-streamed ``text_completion``; ``echo`` holds each prompt's text to prepend."""
    choices = []
    for i, out in enumerate(outputs):
        prefix = echo[i] if echo is not None else ""
        for j, c in enumerate(out.outputs):
            choices.append({
                "index": i * len(out.outputs) + j, "text": prefix + c.text,
                "logprobs": completion_logprobs(c, k, len(prefix)),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            })  # fmt: skip
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(outputs)}  # fmt: skip


def chat_message(c: CompletionOutput) -> JSON:
    """A whole assistant message: ``content`` (null when the reply is only tool calls, as
    OpenAI's), ``tool_calls`` when there are any, ``reasoning`` (and ``reasoning_content``, its
    name in older clients) when the reply thought."""
    message: JSON = {"role": "assistant", "content": c.text}
    if c.tool_calls:
        message["tool_calls"] = [
            {"id": call.id, "type": call.type,
             "function": {"name": call.name, "arguments": call.arguments}}
            for call in c.tool_calls
        ]  # fmt: skip
        if not c.text.strip():
            message["content"] = None
    if c.reasoning is not None:
        message["reasoning"] = message["reasoning_content"] = c.reasoning
    return message


def chat_response(rid: str, model: str, out: RequestOutput, k: int) -> JSON:
    choices = [
        {"index": j, "message": chat_message(c),
         "logprobs": chat_logprobs(c, k), "finish_reason": c.finish_reason,
         "stop_reason": c.stop_reason}
        for j, c in enumerate(out.outputs)
    ]  # fmt: skip
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage([out])}  # fmt: skip


def _tool_call_chunk(delta: ToolCallDelta) -> JSON:
    """One ``delta.tool_calls`` entry, as OpenAI streams it: the call's first chunk carries
    its ``id``, ``type`` and ``function.name``; every chunk a fragment of the arguments."""
    function: JSON = {"arguments": delta.arguments}
    entry: JSON = {"index": delta.index, "function": function}
    if delta.id is not None:
        entry["id"], entry["type"] = delta.id, "function"
    if delta.name is not None:
        function["name"] = delta.name
    return entry


@dataclass(slots=True)
class ChunkWriter:
    """Turns DELTA outputs into ``text_completion`` or ``chat.completion.chunk`` chunks.

    Choice ``index`` is ``prompt_index * n + position``. A chat choice's first chunk carries
    ``role``; a choice's last chunk carries its ``finish_reason`` (with what is new).
    """

    rid: str
    model: str
    chat: bool
    k: int  # top logprobs per token
    created: int = field(default_factory=lambda: int(time.time()))
    _offsets: dict[int, int] = field(default_factory=dict)  # completions: text_offset so far
    _started: set[int] = field(default_factory=set)

    def chunks(self, prompt_index: int, out: RequestOutput, echo: str = "") -> list[JSON]:
        n = len(out.outputs)
        chunks = []
        for j, c in enumerate(out.outputs):
            index = prompt_index * n + j
            first = index not in self._started
            if not (c.text or c.token_ids or c.finish_reason or first or c.reasoning
                    or c.tool_call_deltas):  # fmt: skip
                continue
            self._started.add(index)
            chunks.append(self._chat(index, c, first) if self.chat else
                          self._completion(index, c, echo if first else ""))  # fmt: skip
        return chunks

    def _completion(self, index: int, c: CompletionOutput, echo: str) -> JSON:
        offset = self._offsets.get(index, 0) + len(echo)
        self._offsets[index] = offset + len(c.text)
        choice = {"index": index, "text": echo + c.text,
                  "logprobs": completion_logprobs(c, self.k, offset),
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}  # fmt: skip
        return self._wrap("text_completion", choice)

    def _chat(self, index: int, c: CompletionOutput, first: bool) -> JSON:
        delta: JSON = {"role": "assistant", "content": c.text} if first else {}
        if c.text and not first:
            delta["content"] = c.text
        if c.reasoning:
            delta["reasoning"] = delta["reasoning_content"] = c.reasoning
        if c.tool_call_deltas:
            delta["tool_calls"] = [_tool_call_chunk(d) for d in c.tool_call_deltas]
        choice = {"index": index, "delta": delta, "logprobs": chat_logprobs(c, self.k),
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}  # fmt: skip
        return self._wrap("chat.completion.chunk", choice)

    def _wrap(self, kind: str, choice: JSON) -> JSON:
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model,
                "choices": [choice]}  # fmt: skip

    def usage_chunk(self, outputs: Sequence[RequestOutput]) -> JSON:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model,
                "choices": [], "usage": usage(outputs)}  # fmt: skip
