"""One tool call written as a JSON object (``{"name": "f", "arguments": {...}}``, or the bare
arguments object of a call whose name the markup gave), read as it streams and announced as
soon as its name and the start of its arguments are known."""

from __future__ import annotations

import json
from collections.abc import Callable

from asyncpaged.tool_parsers.delta_builder import DeltaBuilder
from asyncpaged.tool_parsers.json_object import JsonObjectScanner, Member

__all__ = ["ARGUMENT_KEYS", "JsonCall"]

ARGUMENT_KEYS = ("arguments", "parameters")
"""The keys under which a call object may hold its arguments (exactly one of them)."""


class JsonCall:
    """A call object being read, with the markup text before it (``prefix``).

    Its arguments are the text of the arguments value as written, from its ``{`` to its ``}``;
    they stream out (:meth:`flush`) as they arrive, once the name is known. :meth:`close`
    decides the call when its markup ends: a valid call emits the rest of its arguments, an
    invalid one becomes content (all of its text if it was never announced, else what was not
    emitted as arguments).

    Invariants: the arguments emitted are a prefix of the arguments value's text; a call is
    announced at most once, and only with a name ``is_known_tool`` accepts.
    """

    def __init__(
        self,
        prefix: str,
        is_known_tool: Callable[[str], bool],
        *,
        name: str | None = None,
    ) -> None:
        self._prefix = prefix
        self._is_known_tool = is_known_tool
        self._given_name = name
        self._name: str | None = name
        self._object = JsonObjectScanner()
        self._index: int | None = None
        self._num_emitted = 0
        self._arguments_offset = 0

    @property
    def is_complete(self) -> bool:
        """The object's closing ``}`` was read."""
        return self._object.is_complete

    @property
    def is_failed(self) -> bool:
        """The text stopped being a JSON object."""
        return self._object.is_failed

    @property
    def is_announced(self) -> bool:
        """The call's id and name were emitted."""
        return self._index is not None

    def consume(self, text: str) -> int:
        """Read the object's next text; return how much belongs to it (see JsonObjectScanner)."""
        return self._object.consume(text)

    def flush(self, out: DeltaBuilder) -> None:
        """Announce the call and emit its new arguments text, as far as they are known."""
        if self.is_failed:
            return
        name = self._known_name()
        arguments = self._arguments_so_far()
        if name is not None and arguments is not None and self._is_known_tool(name):
            self._emit(out, name, *arguments)

    def close(self, out: DeltaBuilder, suffix: str = "") -> bool:
        """The call's markup ended (``suffix``: the text after the object, markup included).
        Emit the call if it is valid and return True; else emit its text as content."""
        valid = self._validated()
        if valid is not None:
            self._emit(out, *valid)
            return True
        text = self._prefix + self._object.text + suffix
        if self._index is None:
            out.add_content(text)
        else:
            out.add_content(text[self._arguments_offset + self._num_emitted :])
        return False

    def _emit(self, out: DeltaBuilder, name: str, start: int, arguments: str) -> None:
        if self._index is None:
            self._index = out.start_call(name)
            self._arguments_offset = len(self._prefix) + start
        out.add_arguments(self._index, arguments[self._num_emitted :])
        self._num_emitted = len(arguments)

    def _known_name(self) -> str | None:
        if self._name is None:
            member = self._member(("name",))
            if member is not None and member.value_end is not None:
                try:
                    value = json.loads(self._object.text[member.value_start : member.value_end])
                except (ValueError, RecursionError):
                    value = None
                if isinstance(value, str):
                    self._name = value
        return self._name

    def _member(self, keys: tuple[str, ...]) -> Member | None:
        return next((m for m in self._object.members if m.key in keys), None)

    def _arguments_so_far(self) -> tuple[int, str] | None:
        """(where the arguments start in the object's text, their text so far), once they
        have started with ``{``."""
        text = self._object.text
        if self._given_name is not None:
            return 0, text
        member = self._member(ARGUMENT_KEYS)
        if member is None:
            return None
        end = len(text) if member.value_end is None else member.value_end
        arguments = text[member.value_start : end]
        return (member.value_start, arguments) if arguments.startswith("{") else None

    def _validated(self) -> tuple[str, int, str] | None:
        """(name, where the arguments start, their text) of a complete, valid call."""
        if not self.is_complete:
            return None
        try:
            decoded = json.loads(self._object.text)
        except (ValueError, RecursionError):
            return None
        if not isinstance(decoded, dict):
            return None
        if self._given_name is not None:
            if not self._is_known_tool(self._given_name):
                return None
            return self._given_name, 0, self._object.text
        name = decoded.get("name")
        keys = [key for key in ARGUMENT_KEYS if key in decoded]
        arguments = self._arguments_so_far()
        if (
            not isinstance(name, str)
            or name != self._known_name()
            or not self._is_known_tool(name)
            or len(keys) != 1
            or not isinstance(decoded[keys[0]], dict)
            or arguments is None
            or _decoded(arguments[1]) != decoded[keys[0]]
        ):
            return None
        return name, *arguments


def _decoded(text: str) -> object:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _INVALID


_INVALID = object()
