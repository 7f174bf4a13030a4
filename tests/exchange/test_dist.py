"""dist: waiting for the device metadata all-gather never blocks past the timeout; the overlap
thread's metadata never goes on the device."""

import pytest

from reorder.exchange.collectives import CollectiveError
import reorder.exchange.dist as rd
from reorder.exchange.dist import _wait, build_groups


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


@pytest.mark.parametrize("device", ["cuda:0", None])
def test_overlap_metadata_stays_on_the_host(monkeypatch, device):
    """The overlap thread's window frame travels on Gloo even when the payload group has NCCL: a
    device collective that waits for a peer whose worker waits for its consumer would hold up a
    training loop that synchronizes the whole device (Megatron's pipeline P2P does), and that peer's
    consumer may wait for this rank's pipeline stage: a deadlock. The synchronous pair keeps the
    faster device metadata: it runs on the consumer's thread, in program order."""
    made = []

    class Group:
        def __init__(self, ranks, backend):
            self.ranks, self.backend = ranks, backend
            made.append(self)

    monkeypatch.setattr(rd.dist, "new_group", lambda ranks, backend, timeout: Group(ranks, backend))
    monkeypatch.setattr(rd.dist, "get_rank", lambda group=None: 0 if group is None else group.ranks.index(0))
    monkeypatch.setattr(rd.dist, "get_world_size", lambda group=None: len(group.ranks))
    monkeypatch.setattr(rd.torch.cuda, "is_available", lambda: True)
    rg = build_groups({"language": [[0, 1]]}, device=device, overlap=True)
    assert "nccl" in rg.main.data_group.backend and "nccl" in rg.side.data_group.backend
    assert rg.main.meta_on_device
    assert not rg.side.meta_on_device
    assert rg.side.meta_group.backend == "gloo" and rg.side.meta_group is not rg.main.meta_group
