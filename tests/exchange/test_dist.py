"""dist: waiting for the device metadata all-gather never blocks past the timeout."""

import pytest

from reorder.exchange.collectives import CollectiveError
from reorder.exchange.dist import _wait


class _Event:
    """A CUDA-event stand-in that completes after `polls` queries (never when None)."""

    def __init__(self, polls):
        self.polls, self.queries = polls, 0

    def query(self):
        self.queries += 1
        return self.polls is not None and self.queries > self.polls


def test_wait_returns_once_the_event_completes():
    ev = _Event(polls=50)
    _wait(ev, timeout=5.0, what="gather")
    assert ev.queries == 51


def test_wait_raises_after_the_timeout_instead_of_hanging():
    ev = _Event(polls=None)
    with pytest.raises(CollectiveError, match="gather on rank 3 timed out after 0 s: a peer did not arrive"):
        _wait(ev, timeout=0.05, what="gather on rank 3")
    assert ev.queries > 10  # it kept polling until the deadline


def test_wait_without_spin_polls_sparingly():
    """On the overlap thread (spin 0) each poll would take the GIL from the training thread: it
    sleeps a millisecond between polls from the start."""
    ev = _Event(polls=None)
    with pytest.raises(CollectiveError):
        _wait(ev, timeout=0.05, what="gather", spin=0.0)
    assert ev.queries <= 60  # ~1 ms apart, not the 50 us of the synchronous path
