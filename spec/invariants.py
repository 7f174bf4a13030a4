"""Executable invariants I1-I8 of docs/design.md, Invariants: each function checks one property on plain
Python data (sample identities, orders, bytes) and raises InvariantViolation explaining exactly
what broke. Never imports `reorder`."""

from __future__ import annotations

from collections import Counter

from spec import reference


class InvariantViolation(AssertionError):
    """An invariant of the spec does not hold; the message says which, where and how."""


def _fail(name, msg):
    raise InvariantViolation(f"{name} violated: {msg}")


def i1_module_independent_cost(costs_by_module):
    """I1: every module / PP stage computed the same cost for every sample (bit-exact)."""
    names = list(costs_by_module)
    ref_name = names[0]
    ref = list(costs_by_module[ref_name])
    for name in names[1:]:
        got = list(costs_by_module[name])
        if len(got) != len(ref):
            _fail("I1", f"{name} has {len(got)} costs, {ref_name} has {len(ref)}")
        for i, (a, b) in enumerate(zip(ref, got)):
            if a != b:
                _fail("I1", f"sample {i}: cost {b!r} on {name} != {a!r} on {ref_name}")


def i2_identical_assignment(orders_by_module, dp_by_module, batch):
    """I2: all modules derived the same canonical order; owners nest (coarse = fine // k)."""
    names = list(orders_by_module)
    ref_name = names[0]
    ref = list(orders_by_module[ref_name])
    for name in names[1:]:
        got = list(orders_by_module[name])
        if got != ref:
            diff = next(p for p in range(len(ref)) if p >= len(got) or got[p] != ref[p])
            _fail("I2", f"canonical order of {name} differs from {ref_name} at position {diff}: "
                        f"{got[diff] if diff < len(got) else None} vs {ref[diff]}")
    pos = reference.canonical_position(ref)
    for a in names:
        for b in names:
            da, db = dp_by_module[a], dp_by_module[b]
            if db % da or da > db:
                continue
            k = db // da
            for i in range(batch):
                oa = pos[i] // (batch // da)
                ob = pos[i] // (batch // db)
                if oa != ob // k:
                    _fail("I2", f"sample {i}: owner {oa} on {a} (dp {da}) != {ob}//{k} on {b}")


def i3_equal_count(order, groups, batch, held_by_rank, dp):
    """I3: each group has B/G positions, each rank holds exactly B/d samples per slot."""
    if len(order) != batch:
        _fail("I3", f"order has {len(order)} positions, expected B={batch}")
    if batch % groups:
        _fail("I3", f"B={batch} not divisible by G={groups}")
    for r, held in enumerate(held_by_rank):
        if len(held) != batch // dp:
            _fail("I3", f"rank {r} of dp {dp} holds {len(held)} samples, expected {batch // dp}")


def i4_canonical_reassembly(order, batch, dp, held_by_rank):
    """I4: rank r holds canonical positions [r*B/d, (r+1)*B/d) in ascending order."""
    share = batch // dp
    for r, held in enumerate(held_by_rank):
        want = [order[p] for p in range(r * share, (r + 1) * share)]
        if list(held) != want:
            _fail("I4", f"rank {r} holds {list(held)}, canonical positions "
                        f"[{r * share},{(r + 1) * share}) are {want}")


def i4_bridge_alignment(vision_held, language_held):
    """I4 across modules: vision rank v's batch == language ranks v*k..v*k+k-1 concatenated."""
    dv, dl = len(vision_held), len(language_held)
    if dl % dv:
        _fail("I4", f"language dp {dl} is not a multiple of vision dp {dv}")
    fanin = reference.bridge_fanin(language_held, dv, dl)
    for v in range(dv):
        if list(vision_held[v]) != fanin[v]:
            _fail("I4", f"vision rank {v} holds {list(vision_held[v])} but language ranks "
                        f"{v * (dl // dv)}..{(v + 1) * (dl // dv) - 1} hold {fanin[v]}")


def i5_byte_exact(sent, received):
    """I5: every field of every sample arrived bit-identical. Maps sample id -> {field: bytes}."""
    for sid, fields in received.items():
        if sid not in sent:
            _fail("I5", f"sample {sid!r} received but never sent")
        for field, data in fields.items():
            want = sent[sid].get(field)
            if want != data:
                _fail("I5", f"sample {sid!r} field {field!r}: {len(data)} bytes differ from the "
                            f"{None if want is None else len(want)} bytes sent")
        missing = set(sent[sid]) - set(fields)
        if missing:
            _fail("I5", f"sample {sid!r} lost fields {sorted(missing)}")


def i6_nothing_lost(before_by_slot, after_by_slot):
    """I6: per slot, the multiset of sample ids is unchanged."""
    if len(before_by_slot) != len(after_by_slot):
        _fail("I6", f"{len(before_by_slot)} slots before, {len(after_by_slot)} after")
    for s, (a, b) in enumerate(zip(before_by_slot, after_by_slot)):
        ca, cb = Counter(a), Counter(b)
        if ca != cb:
            lost = sorted((ca - cb).elements())
            dup = sorted((cb - ca).elements())
            _fail("I6", f"slot {s}: lost {lost}, gained/duplicated {dup}")


def i7_no_cross_slot(before_by_slot, after_by_slot):
    """I7: a sample seen in slot s after the exchange was in slot s before."""
    home = {}
    for s, ids in enumerate(before_by_slot):
        for i in ids:
            home[i] = s
    for s, ids in enumerate(after_by_slot):
        for i in ids:
            if home.get(i) != s:
                _fail("I7", f"sample {i!r} moved from slot {home.get(i)} to slot {s}")


def i8_deterministic(plans):
    """I8: every computation of the same plan (ranks, runs, resumes) gave the same result."""
    ref = list(plans[0])
    for k, p in enumerate(plans[1:], 1):
        if list(p) != ref:
            _fail("I8", f"plan #{k} {list(p)} differs from plan #0 {ref}")
