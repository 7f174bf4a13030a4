"""Invariant checks of real exchange outputs against the spec (used by the demo, tests and the
functional suites). Each check raises spec.invariants.InvariantViolation with a precise message."""

from __future__ import annotations

import numpy as np

from reorder.integrations.megatron import select_fields
from spec import invariants as inv
from spec import reference as ref
from spec.samples import per_sample_bytes


def ids_of(batch) -> list:
    return batch["sample_id"].tolist()


def check_rank(global_batch, got, order, dp, rank, *, vision_start_token_id, fields=None):
    """I3, I4 and I5 for one rank: `got` (its reordered micro-batch of the natural `global_batch`,
    tensors on any device) holds B/dp samples, exactly its canonical positions under `order`
    (I4 skipped when order is None), every field byte-exact (only `fields` were loaded)."""
    gids, held = ids_of(global_batch), ids_of(got)
    b = len(gids) // dp
    if len(held) != b:
        raise inv.InvariantViolation(f"I3 violated: rank {rank} of dp {dp} holds {len(held)} samples, expected {b}")
    if order is not None:
        want = [gids[i] for i in list(order)[rank * b:(rank + 1) * b]]
        if held != want:
            raise inv.InvariantViolation(f"I4 violated: rank {rank} holds {held}, canonical positions "
                                         f"[{rank * b},{(rank + 1) * b}) are {want}")
    sent = dict(zip(gids, per_sample_bytes(select_fields(global_batch, fields), vision_start_token_id=vision_start_token_id)))
    inv.i5_byte_exact(sent, dict(zip(held, per_sample_bytes(_to_host(got), vision_start_token_id=vision_start_token_id))))


def check_module(global_batches, outputs, orders, dp, *, groups, vision_start_token_id, fields=None):
    """I3-I7 for one module: outputs[rank][slot] are the reordered micro-batches, global_batches[slot]
    the natural global micro-batches, orders[slot] the canonical order every rank used."""
    batch = global_batches[0]["input_ids"].shape[0]
    before, after = [], []
    for s, g in enumerate(global_batches):
        held = [ids_of(outputs[r][s]) for r in range(dp)]
        inv.i3_equal_count(list(orders[s]), groups, batch, held, dp)
        for r in range(dp):
            check_rank(g, outputs[r][s], orders[s], dp, r, vision_start_token_id=vision_start_token_id, fields=fields)
        before.append(ids_of(g))
        after.append([i for h in held for i in h])
    inv.i6_nothing_lost(before, after)
    inv.i7_no_cross_slot(before, after)


def _to_host(batch):
    """The batch with every tensor on the CPU (no copy for CPU tensors)."""
    if isinstance(batch, dict):
        return {k: _to_host(v) for k, v in batch.items()}
    return batch.cpu() if hasattr(batch, "cpu") else batch


def check_modules(global_batches, held_ids, orders_seen, costs_by_module, dp_by_module, *, groups, balancer):
    """I1, I2, I4 (bridge alignment) and I8 across modules.

    held_ids[module][rank][slot]: sample ids after the exchange; orders_seen[module][rank]: [W, B]
    orders each rank used; costs_by_module[module]: [W, B] costs each module computed.
    """
    names = list(dp_by_module)
    for s in range(len(global_batches)):
        inv.i1_module_independent_cost({m: list(np.asarray(costs_by_module[m])[s]) for m in names})
        per_module = {m: list(np.asarray(orders_seen[m][0])[s]) for m in names}
        inv.i2_identical_assignment(per_module, dp_by_module, len(per_module[names[0]]))
        inv.i8_deterministic([list(np.asarray(o)[s]) for m in names for o in orders_seen[m]])
        if balancer == "lpt":
            want = ref.lpt_order([float(c) for c in np.asarray(costs_by_module[names[0]])[s]], groups)
            inv.i8_deterministic([want, per_module[names[0]]])
        by_dp = sorted(names, key=lambda m: dp_by_module[m])
        for a in by_dp:
            for b in by_dp:
                if dp_by_module[a] < dp_by_module[b] and dp_by_module[b] % dp_by_module[a] == 0:
                    inv.i4_bridge_alignment([held_ids[a][r][s] for r in range(dp_by_module[a])],
                                            [held_ids[b][r][s] for r in range(dp_by_module[b])])


def check_module_ids(global_batches, held_ids, orders, dp, *, groups):
    """I3, I4, I6 and I7 for one module from sample ids alone: held_ids[rank][slot] after the
    exchange, orders[slot] the canonical order the module used."""
    before = [ids_of(g) for g in global_batches]
    for s, gids in enumerate(before):
        held = [held_ids[r][s] for r in range(dp)]
        inv.i3_equal_count(list(orders[s]), groups, len(gids), held, dp)
        inv.i4_canonical_reassembly([gids[i] for i in orders[s]], len(gids), dp, held)
    after = [[i for r in range(dp) for i in held_ids[r][s]] for s in range(len(before))]
    inv.i6_nothing_lost(before, after)
    inv.i7_no_cross_slot(before, after)


def check_world(global_batches, held_ids, orders_seen, costs_by_module, dp_by_module, *, groups, balancer):
    """Every invariant that sample ids, orders and costs show, across modules (`check_modules`) and
    within each (`check_module_ids`); arguments as `check_modules`'."""
    check_modules(global_batches, held_ids, orders_seen, costs_by_module, dp_by_module, groups=groups,
                  balancer=balancer)
    for m, d in dp_by_module.items():
        check_module_ids(global_batches, held_ids[m], np.asarray(orders_seen[m][0]), d, groups=groups)


def field_owner(field: tuple, counts, byte: int) -> int:
    """The sample (index in its micro-batch) whose bytes hold byte `byte` of a field's buffer;
    field: (kind, leading dims, bytes per unit) as `ByteField`, counts: the micro-batch's
    SampleCounts."""
    kind, pre, unit = field
    if kind == "dense":
        return byte // unit % counts.shape[0]
    if kind == "list":
        return int(np.searchsorted(np.cumsum(counts.list_bytes), byte, side="right"))
    entries = counts.rows if kind == "row" else counts.images
    return int(np.searchsorted(np.cumsum(entries), byte // unit, side="right"))
