"""Batch layout: which fields of a micro-batch are per-sample, along which dim, and how big.

A micro-batch is a dict (Qwen-VL style, docs/design.md, Micro-batches):
- tensors with a batch dim: dim 0 by default; `position_ids` of rank 3 ([3, B, S], MRoPE) on dim 1;
  override with `batch_dims={"name": dim}`; a tensor whose batch-dim size is not B is global metadata;
- `modality_inputs = {"images": {encoder: {"hidden_states": [sum P, F], "grid_thw": [n_img, 3]}}}`:
  per-row tensors (leading dim = total patch rows) and per-image tensors (leading dim = images);
  sample s owns the images counted by vision-start tokens in its input_ids row, in order;
- lists of length B are per-sample; everything else is global metadata, kept as-is.

`describe` turns one batch into a `BatchLayout` (fields, dtypes, per-sample shapes) and a `Shard`
(the batch as n samples plus per-sample row / image / list-byte counts). Everything else in reorder
works on shards.
"""

from __future__ import annotations

import functools
import math
import pickle
from dataclasses import dataclass, field

import numpy as np
import torch

Path = tuple  # key path inside the batch dict, e.g. ("modality_inputs", "images", "vit", "grid_thw")

DEFAULT_BATCH_DIMS = {"position_ids": None}  # None: dim 1 if 3-D (MRoPE), else 0


class LayoutError(ValueError):
    """The batch cannot be reordered as given; the message names the field and the fix."""


@dataclass(frozen=True, slots=True)
class DenseField:
    """A tensor with one sample per index along `batch_dim`."""

    path: Path
    batch_dim: int
    dtype: torch.dtype
    sample_shape: tuple  # shape without the batch dim

    @property
    def sample_bytes(self) -> int:
        return math.prod(self.sample_shape) * self.dtype.itemsize

    def full_shape(self, n: int) -> tuple:
        s = list(self.sample_shape)
        s.insert(self.batch_dim, n)
        return tuple(s)


@dataclass(frozen=True, slots=True)
class RaggedField:
    """A vision tensor with a variable number of leading entries per sample (rows or images)."""

    path: Path
    per: str  # "row", "image", or "any" until resolved (a rank whose images each have one patch row, or none)
    dtype: torch.dtype
    entry_shape: tuple

    @property
    def entry_bytes(self) -> int:
        return math.prod(self.entry_shape) * self.dtype.itemsize


# Fields are frozen values: the same field in every micro-batch is one shared object, made once.
_dense_field = functools.lru_cache(maxsize=1024)(DenseField)
_ragged_field = functools.lru_cache(maxsize=1024)(RaggedField)


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """The per-sample structure of a micro-batch; identical on every rank of a module's DP group."""

    dense: tuple  # of DenseField
    ragged: tuple  # of RaggedField
    lists: tuple  # of Path (per-sample python lists)
    grid_thw_path: Path | None  # path of grid_thw (per-image [n, 3]) when the batch carries vision

    @property
    def dense_sample_bytes(self) -> int:
        return sum(f.sample_bytes for f in self.dense)

    @property
    def row_bytes(self) -> int:
        return sum(f.entry_bytes for f in self.ragged if f.per == "row")

    @property
    def image_bytes(self) -> int:
        return sum(f.entry_bytes for f in self.ragged if f.per == "image")

    def resolved(self, kinds: dict | None = None) -> "BatchLayout":
        """This layout with every "any" ragged field given its kind: `kinds[path]` (what the DP group
        decided), else "row". On this rank such a field has as many entries per sample as rows and
        as images, so either kind packs its bytes identically; only a rank that holds a telling
        shape can decide, and the others adopt its kind."""
        return self.adopting(kinds or {}, rest="row")

    def adopting(self, kinds: dict, rest: str = "any") -> "BatchLayout":
        """This layout with each "any" ragged field named in `kinds` given that kind, the others `rest`."""
        if all(f.per != "any" for f in self.ragged):
            return self
        ragged = tuple(_ragged_field(f.path, kinds.get(f.path, rest), f.dtype, f.entry_shape) if f.per == "any"
                       else f for f in self.ragged)
        return BatchLayout(self.dense, ragged, self.lists, self.grid_thw_path)

    def signature(self) -> str:
        """A stable text of everything that must match across ranks to concatenate samples."""
        parts = [f"{'/'.join(f.path)}:d{f.batch_dim}:{str(f.dtype)[6:]}:{list(f.sample_shape)}" for f in self.dense]
        parts += [f"{'/'.join(f.path)}:{f.per}:{str(f.dtype)[6:]}:{list(f.entry_shape)}" for f in self.ragged]
        parts += ["/".join(p) + ":list" for p in self.lists]
        return ";".join(parts)


@dataclass(slots=True)
class Shard:
    """n samples in one order: dense tensors (batch dim per layout), ragged vision tensors with
    per-sample `row_counts` / `image_counts` (int64 numpy arrays), and per-sample list entries."""

    n: int
    dense: dict = field(default_factory=dict)  # Path -> Tensor
    ragged: dict = field(default_factory=dict)  # Path -> Tensor
    row_counts: np.ndarray | None = None
    image_counts: np.ndarray | None = None
    lists: list | None = None  # n tuples, one entry per layout.lists path

    def list_blobs(self) -> list:
        """Per-sample pickled list entries (empty bytes when the layout has no lists)."""
        if not self.lists:
            return [b""] * self.n
        return [pickle.dumps(t, protocol=pickle.HIGHEST_PROTOCOL) for t in self.lists]


def unify(signatures: list) -> dict | None:
    """Per-row / per-image kinds that make the ranks' layout signatures (None: a rank without a
    window) agree, as {path: kind} for the fields some rank left "any"; None when they differ in
    anything else (fields, dtypes, shapes, or a field per-row on one rank and per-image on another)."""
    split = [s.split(";") for s in signatures if s is not None]
    if len({len(parts) for parts in split}) > 1:
        return None
    kinds = {}
    for entries in zip(*split):
        if len(set(entries)) == 1:
            continue
        fields = [e.split(":") for e in entries]
        if any(len(f) != 4 for f in fields) or len({(f[0], f[2], f[3]) for f in fields}) > 1:
            return None
        pers = {f[1] for f in fields} - {"any"}
        if len(pers) != 1 or not pers <= {"row", "image"}:
            return None
        kinds[tuple(fields[0][0].split("/"))] = pers.pop()
    return kinds


def window_layout(layouts: list) -> "BatchLayout":
    """The one layout of a window's micro-batches (as counted on this rank): a field left "any" in
    some micro-batch takes the kind another one shows (a share without images next to one with
    images), as across ranks (`unify`). Raises LayoutError naming the first field that really
    differs (fields, dtypes, per-sample shapes, or per row in one micro-batch and per image in
    another) and the two micro-batches."""
    signatures = [layout.signature() for layout in layouts]
    if len(set(signatures)) == 1:
        return layouts[0]
    kinds = unify(signatures)
    if kinds is not None:
        return layouts[0].adopting(kinds)
    k = next(k for k in range(len(signatures)) if unify(signatures[:k + 1]) is None)
    j = next(j for j in range(k) if unify([signatures[j], signatures[k]]) is None)
    path, (this, that) = first_difference([signatures[k], signatures[j]])
    raise LayoutError(f"micro-batch {k} of the window: field {path!r} is {this}, micro-batch {j} has {that}: every "
                      f"micro-batch must carry the same fields, dtypes and per-sample shapes (pad to a fixed "
                      f"sequence length)")


def first_difference(signatures: list) -> tuple:
    """(path, [what each signature holds there, in words]) of the first field whose entries differ
    across layout signatures (a field one signature lacks is "absent"): the part of a layout
    mismatch that names what to fix, short whatever the number of fields."""
    maps = [dict((e.split(":", 1)[0], e) for e in s.split(";") if e) if s else {} for s in signatures]
    paths = list(dict.fromkeys(p for m in maps for p in m))
    path = next(p for p in paths if len({m.get(p) for m in maps}) > 1)
    return path, [_in_words(m.get(path)) for m in maps]


def _in_words(entry: str | None) -> str:
    """One signature entry in words: 'bfloat16 [4] per row', 'int64 [3, 512] (batch dim 1)', ..."""
    if entry is None:
        return "absent"
    parts = entry.split(":")
    if len(parts) == 2:
        return "a per-sample list"
    _, kind, dtype, shape = parts
    if kind.startswith("d") and kind[1:].isdigit():
        return f"{dtype} {shape} (batch dim {kind[1:]})"
    return f"{dtype} {shape} per {'row or image' if kind == 'any' else kind}"


def field_at(batch, path: Path):
    """The value at key path `path` of the batch dict."""
    for k in path:
        batch = batch[k]
    return batch


def tensors(obj):
    """Every tensor of a (nested) batch: dict values, list and tuple items, depth first."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors(v)


def grid_thw_of(batch) -> torch.Tensor | None:
    """The batch's grid_thw tensor when it carries exactly one (else None: `describe` explains)."""
    mi = batch.get("modality_inputs") if isinstance(batch, dict) else None
    found = [v for p, v in _leaves(mi, (), []) if p[-1] == "grid_thw"] if isinstance(mi, dict) else []
    return found[0] if len(found) == 1 and isinstance(found[0], torch.Tensor) else None


def _leaves(d: dict, path: Path, out: list) -> list:
    """`out` plus (path, value) of every non-dict value of the nested dict `d`, depth first: the
    key paths in dict order; a key that is not a string raises LayoutError."""
    for k, v in d.items():
        if not isinstance(k, str):
            raise LayoutError(f"batch key {k!r} at {'/'.join(path) or '<root>'} is not a string")
        if isinstance(v, dict):
            _leaves(v, path + (k,), out)
        else:
            out.append((path + (k,), v))
    return out


def describe(batch: dict, local_batch: int, *, vision_start_token_id: int,
             batch_dims: dict | None = None, image_counts: np.ndarray | None = None,
             grid_thw_host: np.ndarray | None = None, where: str = "") -> tuple[BatchLayout, Shard]:
    """Split one rank's micro-batch of `local_batch` samples into its layout and a shard
    (image_counts: per-sample vision-start tokens, int64 numpy [local_batch]; grid_thw_host: grid_thw
    already on the host, as int64; where: how error messages name this micro-batch, e.g. "micro-batch 2 ").

    Raises LayoutError for anything that cannot travel: missing input_ids, image counts that do
    not match the vision tensors, or a per-sample field whose batch dim is not `local_batch`.
    """
    dims = {**DEFAULT_BATCH_DIMS, **batch_dims} if batch_dims else DEFAULT_BATCH_DIMS
    if not isinstance(batch, dict):
        raise LayoutError(f"micro-batch is a {type(batch).__name__}: expected a dict of fields")
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise LayoutError("field 'input_ids' must be a [B, S] tensor on every rank: the cost is computed from it")
    if ids.shape[0] != local_batch:
        raise LayoutError(f"field 'input_ids' has {ids.shape[0]} samples, expected B/dp={local_batch}")
    dense, ragged, lists, shard = [], [], [], Shard(n=local_batch)
    leaves = _leaves(batch, (), [])
    vision = [(p, v) for p, v in leaves if len(p) >= 3 and p[0] == "modality_inputs"]
    for path, v in leaves:
        if len(path) >= 3 and path[0] == "modality_inputs":
            continue
        name = path[-1]
        if isinstance(v, torch.Tensor) and (shape := tuple(v.shape)):
            want = dims.get(name, 0)
            if want is None:
                want = 1 if len(shape) == 3 else 0
            if want >= len(shape) or shape[want] != local_batch:
                if name in dims and dims[name] is not None or name in ("input_ids", "labels", "loss_mask",
                                                                      "attention_mask", "position_ids"):
                    raise LayoutError(f"field {'/'.join(path)!r} has shape {shape}: expected "
                                      f"{local_batch} samples along dim {want}")
                continue  # global metadata
            dense.append(_dense_field(path, want, v.dtype, shape[:want] + shape[want + 1:]))
            shard.dense[path] = v
        elif isinstance(v, list) and len(v) == local_batch:
            lists.append(path)
    if lists:
        cols = [field_at(batch, p) for p in lists]
        shard.lists = list(zip(*cols))
    grid_thw_path = None
    if vision:
        grid_thw_path = _describe_vision(vision, ids, vision_start_token_id, ragged, shard, image_counts,
                                         grid_thw_host, where)
    layout = BatchLayout(tuple(dense), tuple(ragged), tuple(lists), grid_thw_path)
    return layout, shard


def _describe_vision(vision, ids, vision_start_token_id, ragged, shard, image_counts=None,
                     grid_thw_host=None, where=""):
    found = [(p, v) for p, v in vision if p[-1] == "grid_thw"]
    if len(found) != 1:
        raise LayoutError(f"modality_inputs must hold exactly one 'grid_thw' tensor, found {len(found)}: "
                          "reorder supports one vision encoder per batch")
    grid_thw_path, grid_thw = found[0]
    if not isinstance(grid_thw, torch.Tensor) or grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        raise LayoutError(f"field {'/'.join(grid_thw_path)!r} must be an [n_images, 3] tensor")
    enc = grid_thw_path[:-1]
    counts = image_counts if image_counts is not None else \
        (ids == vision_start_token_id).sum(dim=1).to("cpu", torch.int64).numpy()
    n_img = int(counts.sum())
    if grid_thw.shape[0] != n_img:
        raise LayoutError(f"field {'/'.join(grid_thw_path)!r} has {grid_thw.shape[0]} images but input_ids holds "
                          f"{n_img} vision-start tokens (id {vision_start_token_id}): image counts are "
                          "mis-sourced or vision_start_token_id is wrong")
    csum = np.zeros(n_img + 1, dtype=np.int64)  # patch rows before each image (host arithmetic)
    if grid_thw_host is None:
        grid_thw_host = grid_thw.to("cpu", torch.int64).numpy()
    _check_grid_thw(grid_thw_host, counts, grid_thw_path, where)
    np.cumsum(grid_thw_host.prod(axis=1), out=csum[1:])
    total_rows = int(csum[-1])
    ends = np.cumsum(counts)
    row_counts = csum[ends] - csum[ends - counts]
    for path, v in vision:
        if path[:-1] != enc:
            raise LayoutError(f"field {'/'.join(path)!r}: only one vision encoder dict is supported "
                              f"(found {'/'.join(enc)!r} too)")
        if not isinstance(v, torch.Tensor) or v.dim() < 1:
            raise LayoutError(f"field {'/'.join(path)!r} must be a tensor with a leading row or image dim")
        if path == grid_thw_path or (path[-1] != "hidden_states" and v.shape[0] == n_img and n_img != total_rows):
            per = "image"
        elif path[-1] != "hidden_states" and v.shape[0] == n_img == total_rows:
            per = "any"  # as many images as rows here: the DP group decides (BatchLayout.resolved)
        elif v.shape[0] == total_rows:
            per = "row"
        else:
            raise LayoutError(f"field {'/'.join(path)!r} has {v.shape[0]} rows but grid_thw sums to "
                              f"{total_rows} patch rows over {n_img} images")
        ragged.append(_ragged_field(path, per, v.dtype, tuple(v.shape[1:])))
        shard.ragged[path] = v
    shard.row_counts = row_counts
    shard.image_counts = counts
    return grid_thw_path


def _check_grid_thw(grid_thw_host: np.ndarray, image_counts: np.ndarray, grid_thw_path: Path, where: str) -> None:
    """Every t, h, w of grid_thw must be >= 1 (a product of negatives can still match the rows)."""
    if not grid_thw_host.size or grid_thw_host.min() >= 1:
        return
    bad = np.flatnonzero((grid_thw_host < 1).any(axis=1))
    if len(bad):
        i = int(bad[0])
        ends = np.cumsum(image_counts)
        sample = int(np.searchsorted(ends, i, side="right"))
        first = int(ends[sample] - image_counts[sample])
        raise LayoutError(f"{where}sample {sample} image {i - first}: grid_thw {grid_thw_host[i].tolist()} has a "
                          f"component < 1: every t, h, w must be an integer >= 1 (field {'/'.join(grid_thw_path)!r})")


def rebuild(template: dict, layout: BatchLayout, shard: Shard) -> dict:
    """A micro-batch with the template's structure and global metadata, holding the shard's samples.
    (A plain recursive function, not a closure: a self-referencing closure would be a reference
    cycle holding the shard, so device memory would wait for the garbage collector.)"""
    return _put(template, (), layout, shard)


def _put(obj, path, layout, shard):
    if isinstance(obj, dict):
        return {k: _put(v, path + (k,), layout, shard) for k, v in obj.items()}
    if path in shard.dense:
        return shard.dense[path]
    if path in shard.ragged:
        return shard.ragged[path]
    if path in layout.lists:
        j = layout.lists.index(path)
        return [t[j] for t in shard.lists]
    return obj
