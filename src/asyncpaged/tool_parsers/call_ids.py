"""The ids given to tool calls: OpenAI-style by default, Mistral's 9 alphanumerics for Mistral
models (their chat templates refuse any other id when the call is sent back)."""

from __future__ import annotations

import secrets
import string

__all__ = ["mistral_call_id", "random_call_id"]

_ALPHANUMERICS = string.ascii_letters + string.digits


def random_call_id() -> str:
    """``"call_"`` and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


def mistral_call_id() -> str:
    """9 random letters and digits, the id Mistral's chat templates accept."""
    return "".join(secrets.choice(_ALPHANUMERICS) for _ in range(9))
