"""Finding markup strings (``<tool_call>``, ``[TOOL_CALLS]``) in streamed text, where a marker
may be cut between two pieces."""

from __future__ import annotations

__all__ = ["WHITESPACE", "is_partial_marker", "partial_marker_length"]

WHITESPACE = " \t\n\r"
"""The whitespace of JSON (and of the markup around calls)."""


def partial_marker_length(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of ``marker``: how
    much of ``text`` must be held back because the next piece may complete the marker."""
    start = max(len(text) - len(marker) + 1, 0)
    while True:
        i = text.find(marker[0], start)
        if i < 0:
            return 0
        if marker.startswith(text[i:]):
            return len(text) - i
        start = i + 1


def is_partial_marker(text: str, marker: str) -> bool:
    """Whether ``text`` is a proper beginning of ``marker`` (the empty string included)."""
    return len(text) < len(marker) and marker.startswith(text)
