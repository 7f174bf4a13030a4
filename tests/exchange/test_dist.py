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


@pytest.mark.parametrize("device, meets", [("cuda:0", True), (None, True), ("cpu", False)])
def test_overlap_pair_meets_on_the_host_right_before_its_all_to_all(monkeypatch, device, meets):
    """The overlap thread launches its all_to_all only once every peer's thread is at the same
    launch: between the window's frame and the launch a thread may wait for its whole device (a
    kernel's first launch, a compile, a graph capture), and so for its consumer's queued collectives,
    while a peer's launched all_to_all held up that peer's device. The receive buffer is allocated
    before the meeting (an allocation that frees cached blocks waits for the device too), the meeting
    is a Gloo collective of a host tensor, and nothing else comes between it and the launch. A Gloo
    payload needs no meeting: its all_to_all is one on the host itself."""
    calls = []

    class Group:
        def __init__(self, ranks, backend):
            self.ranks, self.backend = ranks, backend

    monkeypatch.setattr(rd.dist, "new_group", lambda ranks, backend, timeout: Group(ranks, backend))
    monkeypatch.setattr(rd.dist, "get_rank", lambda group=None: 0 if group is None else group.ranks.index(0))
    monkeypatch.setattr(rd.dist, "get_world_size", lambda group=None: len(group.ranks))
    monkeypatch.setattr(rd.torch.cuda, "is_available", lambda: True)
    rg = build_groups({"language": [[0, 1]]}, device=device, overlap=True)
    assert rg.side.launch_rendezvous is meets
    assert not rg.main.launch_rendezvous  # the synchronous pair runs in the consumer's program order

    real_empty = rd.torch.empty
    monkeypatch.setattr(rd.torch, "empty", lambda *a, **k: calls.append(("alloc",)) or real_empty(*a, **k))
    monkeypatch.setattr(rd.dist, "all_reduce", lambda t, group: calls.append(("meet", group.backend, t.device.type)))
    monkeypatch.setattr(rd.dist, "all_to_all_single", lambda recv, send, output_split_sizes, input_split_sizes, group:
                        calls.append(("launch", group.backend)))
    send = rd.torch.arange(6, dtype=rd.torch.uint8)
    for pair in (rg.side, rg.main):
        calls.clear()
        recv = pair.all_to_all(send, [3, 3], [2, 4])
        assert len(recv) == 6
        met = [("meet", "gloo", "cpu")] if pair is rg.side and meets else []
        assert calls == [("alloc",)] + met + [("launch", pair.data_group.backend)]


def test_a_failed_meeting_raises_collective_error(monkeypatch):
    """A peer that never reaches the launch (Gloo's timeout) raises CollectiveError naming the rank,
    as a failed all_to_all does."""

    class Group:
        backend = "gloo"

    monkeypatch.setattr(rd.dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(rd.dist, "get_world_size", lambda group=None: 2)

    def timed_out(t, group):
        raise RuntimeError("Timed out waiting 300000ms for recv operation to complete")

    monkeypatch.setattr(rd.dist, "all_reduce", timed_out)
    monkeypatch.setattr(rd.dist, "all_to_all_single", lambda *a, **k: pytest.fail("launched without its peers"))
    pair = rd.TorchCollectives(Group(), Group(), launch_rendezvous=True)
    with pytest.raises(CollectiveError, match="reorder all_to_all failed on rank 1: Timed out waiting"):
        pair.all_to_all(rd.torch.zeros(4, dtype=rd.torch.uint8), [2, 2], [2, 2])
