"""Window routes and reassembly against the spec's slow reference."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from reorder.plan.routes import window_routes
from spec import reference as ref


@st.composite
def windows(draw):
    dp = draw(st.integers(1, 8))
    b = draw(st.integers(1, 6))
    slots = draw(st.integers(1, 4))
    batch = dp * b
    orders = [draw(st.permutations(range(batch))) for _ in range(slots)]
    return dp, batch, np.array(orders, dtype=np.int64)


@given(windows())
def test_routes_match_spec(w):
    dp, batch, orders = w
    b = batch // dp
    for rank in range(dp):
        routes = window_routes(orders, dp, rank)
        sends, recvs = ref.window_routes([list(o) for o in orders], batch, dp, rank)
        for q in range(dp):
            if q == rank:
                assert len(routes.send_index[q]) == 0 and len(routes.recv_natural[q]) == 0
                continue
            got_send = [(int(i) // b, rank * b + int(i) % b) for i in routes.send_index[q]]
            assert got_send == sends[q]
            got_recv = [(int(i) // batch, int(i) % batch) for i in routes.recv_natural[q]]
            assert got_recv == recvs[q]
        # reassembly: simulate the combined source list per slot and apply the gather
        held = ref.reassemble([list(o) for o in orders], [list(range(batch))] * len(orders), batch, dp, rank)
        for s in range(len(orders)):
            combined = list(range(rank * b, (rank + 1) * b))
            for q in range(dp):
                if q != rank:
                    combined += [j for (slot, j) in recvs[q] if slot == s]
            assert [combined[i] for i in routes.gather[s]] == held[s]
        assert routes.moved_samples == sum(len(sends[q]) for q in range(dp) if q != rank)
