"""The test-only slow-decode fault: parsed strictly, and it really holds the engine's thread after each token."""

from __future__ import annotations

import time

import pytest

from tilepd.runtime.faults import SLOW_TOKEN_ENV, slow_token_delay, slowed


def test_no_fault_unless_asked() -> None:
    assert slow_token_delay({}) == 0.0
    seen: list[int] = []
    cb = seen.append
    assert slowed(cb, 0.0) is cb


@pytest.mark.parametrize("raw", ["fast", "-1", "11"])
def test_a_bad_value_is_refused_naming_the_variable(raw: str) -> None:
    with pytest.raises(ValueError, match=SLOW_TOKEN_ENV):
        slow_token_delay({SLOW_TOKEN_ENV: raw})


def test_each_token_is_held() -> None:
    seen: list[int] = []
    held = slowed(seen.append, slow_token_delay({SLOW_TOKEN_ENV: "0.05"}))
    t0 = time.monotonic()
    for t in range(4):
        held(t)
    assert seen == [0, 1, 2, 3] and time.monotonic() - t0 >= 0.2
