"""`KeepAlive`: tensors read by a kernel through their addresses stay referenced until the event
recorded after the launch completes, released in launch order, all of them at `wait`; a hold of
nothing records no event. CUDA events are replaced by fakes whose completion the test sets."""

import gc
import weakref

import pytest
import torch

from reorder.batch import keepalive
from reorder.batch.keepalive import KeepAlive


class FakeEvent:
    """A CUDA event whose completion the test decides; `synchronize` completes it."""

    made = []

    def __init__(self):
        self.done, self.stream = False, None
        FakeEvent.made.append(self)

    def record(self, stream):  # recorded again: pending until the test completes it
        self.stream, self.done = stream, False

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


@pytest.fixture
def events(monkeypatch):
    FakeEvent.made = []
    monkeypatch.setattr(keepalive.torch.cuda, "Event", FakeEvent)
    return FakeEvent.made


def held(refs):
    gc.collect()
    return [r() is not None for r in refs]


def test_held_tensors_live_until_their_event_completes_and_go_in_launch_order(events):
    alive = KeepAlive()
    tensors = [torch.arange(4) + i for i in range(3)]
    refs = [weakref.ref(t) for t in tensors]
    for t in tensors:
        alive.hold([t], stream="s")
    del tensors, t
    assert held(refs) == [True, True, True] and len(alive) == 3
    assert [e.stream for e in events] == ["s"] * 3
    events[1].done = True  # a later launch done before an earlier one: nothing goes out of order
    alive.hold([], stream="s")
    assert held(refs) == [True, True, True]
    events[0].done = True
    alive.hold([], stream="s")  # the first two go; the third's work remains
    assert held(refs) == [False, False, True] and len(alive) == 1 and len(events) == 3  # no event for []
    alive.wait()
    assert held(refs) == [False, False, False] and len(alive) == 0 and all(e.done for e in events)


def test_one_holder_serves_launches_of_several_streams(events):
    alive = KeepAlive()
    a, b, c = [torch.zeros(1)], [torch.ones(1)], [torch.ones(2)]
    alive.hold(a, "s0")
    alive.hold([], "s0")                                   # nothing to hold: no event
    alive.hold(b, "s1")
    assert [(e.stream, t) for _, e, t in alive._pending] == [("s0", a), ("s1", b)]
    events[0].done = True
    alive.hold(c, "s2")                                    # the first launch is done: let go of a
    assert [(e.stream, t) for _, e, t in alive._pending] == [("s1", b), ("s2", c)]


class FakeStream:
    def __init__(self, device_index):
        self.device_index = device_index


def test_a_done_event_is_recorded_again_on_its_device_and_a_pending_one_never(events):
    """A hold records an event whose work is done (let go of by a hold or by `wait`) instead of
    making one, on streams of the device it was recorded on; a pending event is never recorded
    again; each device has its own."""
    alive = KeepAlive()
    s0, s1 = FakeStream(0), FakeStream(1)
    alive.hold([torch.zeros(1)], s0)
    alive.hold([torch.zeros(1)], s0)                       # the first is pending: a second event
    assert len(events) == 2
    events[0].done = True
    alive.hold([torch.zeros(1)], s0)                       # the first is done: recorded again
    assert len(events) == 2 and [e for _, e, _ in alive._pending] == [events[1], events[0]]
    assert events[0].stream is s0
    events[1].done = True
    alive.hold([torch.zeros(1)], s1)                       # device 0's done event is not recorded on device 1
    assert len(events) == 3 and events[2].stream is s1
    alive.wait()                                           # every event done: device 0's two, device 1's one
    alive.hold([torch.zeros(1)], s1)
    alive.hold([torch.zeros(1)], s0)
    alive.hold([torch.zeros(1)], s0)
    assert len(events) == 3 and alive._done == {0: [], 1: []}
    assert [(e, e.stream) for _, e, _ in alive._pending] == [(events[2], s1), (events[0], s0), (events[1], s0)]


def test_the_current_stream_is_looked_up_by_its_handle_and_made_once_per_stream(monkeypatch):
    """`current_stream` returns torch's current stream of the device, made once per (device, handle):
    the same object while the handle stays, another once the current stream changes (as under
    `torch.cuda.stream`), the first again when it comes back; a device index and a device alike."""
    current = {0: 11, 1: 21}  # device index -> its current stream's handle
    made = []

    def make(index):
        made.append((index, current[index]))
        return ("stream", index, current[index])

    keepalive._stream.cache_clear()
    monkeypatch.setattr(keepalive.torch._C, "_cuda_getCurrentRawStream", lambda index: current[index], raising=False)
    monkeypatch.setattr(keepalive.torch.cuda, "current_stream", make)
    first = keepalive.current_stream(0)
    assert first == ("stream", 0, 11) and keepalive.current_stream(torch.device("cuda", 0)) is first
    current[0] = 12
    assert keepalive.current_stream(0) == ("stream", 0, 12)
    assert keepalive.current_stream(1) == ("stream", 1, 21)
    current[0] = 11
    assert keepalive.current_stream(0) is first and made == [(0, 11), (0, 12), (1, 21)]


def test_streams_made_without_end_are_forgotten_past_64(monkeypatch):
    """The 64 streams looked up last are kept: the 65th pushes out the one looked up longest ago."""
    handle = [0]
    keepalive._stream.cache_clear()
    monkeypatch.setattr(keepalive.torch._C, "_cuda_getCurrentRawStream", lambda index: handle[0], raising=False)
    monkeypatch.setattr(keepalive.torch.cuda, "current_stream", lambda index: object())
    made = {}
    for handle[0] in range(64):
        made[handle[0]] = keepalive.current_stream(0)
    handle[0] = 0
    assert keepalive.current_stream(0) is made[0]  # now the one looked up last
    handle[0] = 64
    keepalive.current_stream(0)
    assert keepalive._stream.cache_info().currsize == 64
    handle[0] = 1
    assert keepalive.current_stream(0) is not made[1]  # forgotten, made again
    handle[0] = 0
    assert keepalive.current_stream(0) is made[0]
