"""The gate backoff state machine against the spec's statement of the rule."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reorder.plan.backoff import Backoff
from spec import reference as ref


def skips(fully_gated, cap):
    state, out = Backoff(cap), []
    for gated in fully_gated:
        if state.skip:
            out.append(True)
            state = state.skipped()
        else:
            out.append(False)
            state = state.planned(gated)
    return out


@given(st.lists(st.booleans(), max_size=60), st.integers(0, 9))
def test_skips_match_the_spec(fully_gated, cap):
    assert skips(fully_gated, cap) == ref.gate_backoff_skips(fully_gated, cap)


def test_doubles_up_to_its_cap_and_resets_when_a_window_moves():
    # planned windows P, skipped S: gated P -> 1 S, gated P -> 2 S, gated P -> 4 S (cap 4), then 4 S again
    assert skips([True] * 16, 4) == [False, True, False, True, True, False] + [True] * 4 + [False] + [True] * 4 + [False]
    assert skips([True, True, False, True, False], 8) == [False, True, False, False, True]


@pytest.mark.parametrize("cap", [-1, 1.5, True, "2", None])
def test_cap_must_be_a_non_negative_integer(cap):
    with pytest.raises(ValueError) as e:
        Backoff(cap)
    assert str(e.value) == f"gate_backoff={cap!r} is invalid: windows skipped after gated ones must be an integer >= 0"


def test_states():
    assert Backoff(0).planned(True) == Backoff(0)  # never skips, never counts
    assert Backoff(3).planned(True) == Backoff(3, run=1, skip=1)
    assert Backoff(3, run=2, skip=0).planned(True) == Backoff(3, run=3, skip=3)  # min(2**2, 3)
    assert Backoff(3, run=2, skip=0).planned(False) == Backoff(3)
    assert Backoff(3, run=3, skip=2).skipped() == Backoff(3, run=3, skip=1)
