"""Skipping the sandbox's tests where no namespaced isolation works: right on a laptop without user
namespaces, wrong on CI, where the whole security suite would then pass unseen. ``ROLL_REQUIRE_SANDBOX=1``
(set by ``.ci/run``) turns such a skip into a failure."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

REQUIRE_SANDBOX_VAR = "ROLL_REQUIRE_SANDBOX"


def sandbox_required() -> bool:
    return os.environ.get(REQUIRE_SANDBOX_VAR) == "1"


def skip_without_sandbox(reason: str) -> NoReturn:
    """Skip the calling test for ``reason`` (no isolation works here), or fail it when the sandbox is
    required."""
    if sandbox_required():
        pytest.fail(f"{reason}; {REQUIRE_SANDBOX_VAR}=1 requires the sandbox: its tests may not be skipped")
    pytest.skip(reason)
