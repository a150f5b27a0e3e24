"""Test-wide settings: Hypothesis profiles.

CI uses the derandomized ``ci`` profile; ``ASYNCPAGED_HYPOTHESIS_PROFILE=long`` selects a longer,
randomized search (``dev`` is a quick one for editing).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import structlog
from hypothesis import HealthCheck, settings

from asyncpaged.tools import cli_log

settings.register_profile(
    "ci",
    max_examples=500,
    stateful_step_count=50,
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "long",
    max_examples=3000,
    stateful_step_count=100,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=30, stateful_step_count=30, deadline=None)
settings.load_profile(os.environ.get("ASYNCPAGED_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    """The command line configures logging (it is an application); undo it after each test."""
    yield
    structlog.reset_defaults()
    cli_log.reset()
