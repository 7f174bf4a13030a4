"""`python -m reorder simulate`: what-if replay of per-sample costs (a file you logged, or a named
synthetic mix) for a DP layout, micro-batch by micro-batch in file order, with every balancer.

Pure planning only (no torch.distributed, no payloads): the costs of consecutive B samples form one
global micro-batch, `plan_orders` gives each balancer's canonical order over G = lcm(DP sizes), and
`rank_loads` / `orders_moved` judge it for each module's DP size. Predicted straggler time = sum over
micro-batches of the max per-rank cost; saved = 1 - after / before (before = natural contiguous
split, what scalable reads give without reordering).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass

import numpy as np

from reorder.cli.common import (CliError, check_plot_path, human_stream, layout_from_args, make_plot, plural,
                                worse_note, write_json)
from reorder.plan.window import inverse, spreads

DESCRIPTION = """\
Replay per-sample costs micro-batch by micro-batch and report, per balancer and module, the predicted
straggler time saved, the spread (max/mean per-rank cost) before/after and the samples moved.

Input: a CSV file (header row) or JSON lines (one object per line), one sample per row in training order.
  cost          per-sample cost, used as is (any non-negative number)
  patches       vision patches of the sample (all its images; rows of hidden_states = prod(grid_thw))
  image_sizes   the sample's images in pixels, width x height: CSV "640x480;1024x768" (empty: text
                only), JSON [[640, 480], [1024, 768]] (or the CSV string); converted to patches by
                Qwen2-VL's resize rule (--min-pixels, --max-pixels, --patch-size, --merge-size)
  tokens        optional: real (unpadded) text tokens, for --language-weight > 0
The first of cost, patches, image_sizes present is used (or --field). Other columns are ignored.
Blank lines and lines starting with '#' are skipped. Or use --mix NAME for a synthetic stream.

--calibrate LOG reports instead the online cost calibration of a logged run (megatron_mimo_reorder_calibrate
shadow or on; rank 0's INFO lines): every fit's weights, R^2, predicted and measured spread of per-rank step
time and decision, and each switch with the spread measured before and after it.
"""

FIELDS = ("cost", "patches", "image_sizes")
_SIZE = re.compile(r"^\s*([-+]?\d+)\s*[xX\u00d7]\s*([-+]?\d+)\s*$")


def add_args(p: argparse.ArgumentParser):
    from reorder.cli import synthetic as syn
    from reorder.integrations import qwen_resize as qr

    p.add_argument("input", nargs="?", metavar="FILE", help="per-sample CSV or JSON lines file (see above)")
    p.add_argument("--mix", choices=sorted(syn.SIZE_MIXES), help="synthetic image-size mix instead of a file")
    p.add_argument("--samples", type=int, default=4096, help="samples drawn for --mix (default 4096)")
    p.add_argument("--seed", type=int, default=0, help="seed for --mix (default 0)")
    p.add_argument("--format", choices=("csv", "jsonl"), help="input format (default: from the file name, "
                   ".csv / .jsonl .ndjson .json, else sniffed)")
    p.add_argument("--field", choices=FIELDS, help="which column gives the cost (default: first present of "
                   + ", ".join(FIELDS) + ")")
    p.add_argument("--limit", type=int, help="use only the first N samples")
    p.add_argument("--vision-dp", type=int, help="vision encoder DP size (default 2)")
    p.add_argument("--language-dp", type=int, help="language model DP size (default 4)")
    p.add_argument("--dp", metavar="LIST", help="DP sizes of all modules, encoders first and the language model "
                   "last, e.g. 2,4 (instead of the two above)")
    p.add_argument("--micro-batch", type=int, default=16,
                   help="global micro-batch size B, a multiple of lcm(DP sizes) (default 16)")
    p.add_argument("--balancer", action="append", metavar="NAME",
                   help="balancer to evaluate (repeatable; default: all of " + ", ".join(_balancer_names()) + ")")
    p.add_argument("--encoder-weight", type=float, default=1.0, help="cost weight per patch (default 1)")
    p.add_argument("--language-weight", type=float, default=0.0,
                   help="cost weight per real text token (needs a tokens column; default 0)")
    p.add_argument("--min-pixels", type=int, default=qr.MIN_PIXELS, help=f"Qwen resize (default {qr.MIN_PIXELS})")
    p.add_argument("--max-pixels", type=int, default=qr.MAX_PIXELS, help=f"Qwen resize (default {qr.MAX_PIXELS})")
    p.add_argument("--patch-size", type=int, default=qr.PATCH_SIZE, help=f"default {qr.PATCH_SIZE}")
    p.add_argument("--merge-size", type=int, default=qr.MERGE_SIZE, help=f"spatial merge (default {qr.MERGE_SIZE})")
    p.add_argument("--plot", metavar="FILE.png", help="straggler time saved and spread distribution per balancer "
                   "(.png, .pdf or .svg)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE ('-': stdout)")
    p.add_argument("--calibrate", metavar="LOG", help="instead of a replay: the online cost calibration of a "
                   "logged run (rank 0's 'reorder calibration' INFO lines), fit by fit: weights, R^2, predicted vs "
                   "measured spread of per-rank step time, and each switch with the spread before and after it")
    p.add_argument("--progress-after", type=float, default=2.0, help=argparse.SUPPRESS)  # seconds before the bar


def _balancer_names():
    from reorder.plan.balancers import BALANCERS

    first = [n for n in ("identity", "lpt") if n in BALANCERS]
    return first + sorted(n for n in BALANCERS if n not in first)


# ---- input ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Samples:
    """Per-sample inputs in stream order: `cost` (float64, the `cost` field) or `patches` (int64), and
    optional `tokens` (int64); `images` counts images where known. `source` describes the origin."""

    source: str
    field: str
    cost: np.ndarray | None = None
    patches: np.ndarray | None = None
    tokens: np.ndarray | None = None
    images: np.ndarray | None = None

    def __len__(self):
        return len(self.cost if self.cost is not None else self.patches)


class _Bad(Exception):
    """A value problem; the reader adds file, line and field."""


def _show(value) -> str:
    return repr(value) if isinstance(value, str) else json.dumps(value)


def _number(value) -> float:
    if isinstance(value, bool) or value is None or isinstance(value, (list, dict)):
        raise _Bad("is not a number")
    if isinstance(value, str):
        if not value.strip():
            raise _Bad("is empty")
        try:
            value = float(value)
        except ValueError:
            raise _Bad("is not a number") from None
    x = float(value)
    if not math.isfinite(x) or x < 0:
        raise _Bad("must be a finite number >= 0")
    return x


def _count(value) -> int:
    x = _number(value)
    if x != int(x):
        raise _Bad("is not a whole number")
    return int(x)


def _positive(k: int, shown: str, w: int, h: int) -> tuple:
    for side, v in (("width", w), ("height", h)):
        if v < 0:
            raise _Bad(f"has image {k} = {shown!r} whose {side} {v} is negative: sizes are in pixels, width x height")
    return w, h


def _image_sizes(value) -> list:
    """[(w, h), ...] from "WxH;WxH", a list of [w, h] pairs, or nothing (text only)."""
    if value is None or value == "" or value == []:
        return []
    if isinstance(value, str):
        out = []
        for k, part in enumerate(value.split(";"), 1):
            if not part.strip():
                continue
            m = _SIZE.match(part)
            if not m:
                raise _Bad(f"has image {k} = {part.strip()!r}, expected WIDTHxHEIGHT in pixels (e.g. 640x480), "
                           "images separated by ';'")
            out.append(_positive(k, part.strip(), int(m.group(1)), int(m.group(2))))
        return out
    if isinstance(value, list):
        out = []
        for k, pair in enumerate(value, 1):
            if not (isinstance(pair, list) and len(pair) == 2
                    and all(isinstance(v, int) and not isinstance(v, bool) for v in pair)):
                raise _Bad(f"has image {k} = {_show(pair)}, expected a [width, height] pair of integers")
            out.append(_positive(k, _show(pair), pair[0], pair[1]))
        return out
    raise _Bad("is not a list of [width, height] pairs nor a \"WxH;WxH\" string")


class _Reader:
    def __init__(self, path: str, args):
        self.path, self.args = path, args
        self.resize = dict(patch_size=args.patch_size, merge_size=args.merge_size, min_pixels=args.min_pixels,
                           max_pixels=args.max_pixels)
        self._cache = {}

    def fail(self, line, field, value, why):
        where = f"{self.path} line {line}"
        if field is None:
            raise CliError(f"{where}: {why}")
        raise CliError(f"{where}: field '{field}' = {_show(value)} {why}")

    def patches_of(self, sizes, line, field, value) -> int:
        from reorder.integrations.qwen_resize import image_patches

        total = 0
        for w, h in sizes:
            key = (w, h)
            if key not in self._cache:
                try:
                    self._cache[key] = image_patches(w, h, **self.resize)
                except ValueError as e:
                    self.fail(line, field, value, f"cannot be resized: {e}")
            total += self._cache[key]
        return total

    def convert(self, records, field, has_tokens):
        """records: [(line, {key: raw value})] -> Samples."""
        vals, tokens, images = [], [], []
        for line, rec in records:
            if field not in rec:
                hint = "write \"image_sizes\": [] for a text-only sample" if field == "image_sizes" \
                    else "every sample needs one"
                self.fail(line, None, None, f"missing field '{field}' ({hint})")
            raw = rec[field]
            try:
                if field == "cost":
                    vals.append(_number(raw))
                elif field == "patches":
                    vals.append(_count(raw))
                else:
                    sizes = _image_sizes(raw)
                    images.append(len(sizes))
                    vals.append(self.patches_of(sizes, line, field, raw))
            except _Bad as e:
                self.fail(line, field, raw, str(e))
            if has_tokens:
                if "tokens" not in rec:
                    self.fail(line, None, None, "missing field 'tokens' (other samples have one)")
                try:
                    tokens.append(_count(rec["tokens"]))
                except _Bad as e:
                    self.fail(line, "tokens", rec["tokens"], str(e))
        if not vals:
            raise CliError(f"{self.path}: no samples (only a header, blank or comment lines)")
        kw = dict(source=self.path, field=field, tokens=np.asarray(tokens, np.int64) if has_tokens else None,
                  images=np.asarray(images, np.int64) if field == "image_sizes" else None)
        if field == "cost":
            return Samples(cost=np.asarray(vals, np.float64), **kw)
        return Samples(patches=np.asarray(vals, np.int64), **kw)

    def pick_field(self, present, line):
        if self.args.field:
            if self.args.field not in present:
                self.fail(line, None, None, f"no field '{self.args.field}' (--field); found: "
                          + ", ".join(sorted(present)))
            return self.args.field
        for f in FIELDS:
            if f in present:
                return f
        self.fail(line, None, None, "no column named 'cost', 'patches' or 'image_sizes' (found: "
                  + (", ".join(repr(c) for c in present) or "nothing") + ")")

    def lines(self):
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise CliError(f"cannot read {self.path}: {e.strerror}") from None
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            line = data[:e.start].count(b"\n") + 1
            raise CliError(f"{self.path} line {line}: not UTF-8 text (byte 0x{data[e.start]:02x}); "
                           "give a CSV or JSON lines file") from None
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip() and not line.lstrip().startswith("#"):
                yield n, line

    def read_csv(self):
        lines = iter(self.lines())
        first = next(lines, None)
        if first is None:
            raise CliError(f"{self.path}: no samples (the file is empty)")
        hline, header_text = first
        header = [h.strip() for h in next(csv.reader([header_text]))]
        field = self.pick_field([h for h in header if h], hline)
        dup = {h for h in header if h and header.count(h) > 1}
        if dup:
            self.fail(hline, None, None, f"column(s) {sorted(dup)} appear more than once in the header")
        records = []
        for n, text in lines:
            row = next(csv.reader([text]))
            if len(row) != len(header):
                self.fail(n, None, None, f"{len(row)} comma-separated values, the header has {len(header)} "
                          f"({','.join(header)})")
            records.append((n, dict(zip(header, row))))
        return self.convert(records, field, "tokens" in header)

    def read_jsonl(self):
        records, keys = [], {}
        for n, text in self.lines():
            try:
                rec = json.loads(text)
            except json.JSONDecodeError as e:
                self.fail(n, None, None, f"not valid JSON ({e.msg} at column {e.colno}); expected one object "
                          "per line, e.g. {\"patches\": 1024, \"tokens\": 300}")
            if not isinstance(rec, dict):
                self.fail(n, None, None, f"expected a JSON object per line, got {type(rec).__name__}")
            records.append((n, rec))
            for k in rec:
                keys.setdefault(k, n)
        if not records:
            raise CliError(f"{self.path}: no samples (the file is empty)")
        field = self.pick_field(list(keys), records[0][0])
        return self.convert(records, field, "tokens" in keys)


def detect_format(path: str, forced: str | None) -> str:
    if forced:
        return forced
    ext = os.path.splitext(path)[1].lower()
    if ext == ".csv":
        return "csv"
    if ext in (".jsonl", ".ndjson", ".json"):
        return "jsonl"
    try:
        with open(path, "rb") as f:
            head = f.read(4096).lstrip()
    except OSError as e:
        raise CliError(f"cannot read {path}: {e.strerror}") from None
    return "jsonl" if head.startswith(b"{") else "csv"


def load_file(path: str, args) -> Samples:
    reader = _Reader(path, args)
    return reader.read_jsonl() if detect_format(path, args.format) == "jsonl" else reader.read_csv()


def synthetic_samples(mix: str, n: int, seed: int) -> Samples:
    """n samples of a named size mix (reorder.cli.synthetic.SIZE_MIXES): 20% text only, else 1-4 images;
    tokens = 32-1024 text tokens + image placeholders (patches / 4) + 2 markers per image."""
    from reorder.cli import synthetic as syn

    rng = np.random.default_rng(seed)
    k = np.where(rng.random(n) < 0.2, 0, rng.integers(1, 5, size=n))
    grid_thw = syn.draw_images(rng, int(k.sum()), mix)
    per_image = grid_thw.prod(axis=1)
    owner = np.repeat(np.arange(n), k)
    patches = np.bincount(owner, weights=per_image, minlength=n).astype(np.int64)
    tokens = rng.integers(32, 1025, size=n) + patches // 4 + 2 * k
    return Samples(source=f"synthetic mix {mix!r} (seed {seed})", field="patches", patches=patches,
                   tokens=tokens.astype(np.int64), images=k.astype(np.int64))


# ---- replay --------------------------------------------------------------------------------------


def sample_costs(samples: Samples, args) -> np.ndarray:
    from reorder.plan.cost import CostModel

    if samples.field == "cost":
        if args.language_weight or args.encoder_weight != 1.0:
            raise CliError(f"--encoder-weight / --language-weight apply to patches / image_sizes inputs; "
                           f"{samples.source} gives 'cost' directly, which is used as is")
        return samples.cost
    if args.language_weight > 0 and samples.tokens is None:
        raise CliError(f"--language-weight {args.language_weight} needs a 'tokens' column in {samples.source}")
    try:
        model = CostModel(encoder_weight=args.encoder_weight, language_weight=args.language_weight,
                          spatial_merge_size=args.merge_size)
    except ValueError as e:
        raise CliError(str(e)) from None
    placeholders = samples.patches / float(args.merge_size ** 2)  # what input_ids holds per sample
    real = samples.tokens if samples.tokens is not None else np.zeros(len(samples), np.int64)
    return model.costs(placeholders, real)


CHUNK = 256  # micro-batches planned between two updates of the progress bar


def orders_moved(orders: np.ndarray, dp: int) -> np.ndarray:
    """bool [M, B]: natural sample j changes rank in a module of DP size dp."""
    b = orders.shape[1] // dp
    return (inverse(orders) // b) != (np.arange(orders.shape[1]) // b)[None, :]


def _bound(costs: np.ndarray, d: int, tick=None) -> np.ndarray:
    """[M] a proven lower bound of the max per-rank cost of any equal-count split over d ranks
    (reorder.plan.balancers.lower_bound per micro-batch). tick(n): progress, n micro-batches done."""
    from reorder.plan.balancers import lower_bound

    out = np.empty(len(costs))
    for k in range(0, len(costs), CHUNK):
        out[k:k + CHUNK] = [lower_bound(row, d) for row in costs[k:k + CHUNK]]
        if tick:
            tick(len(out[k:k + CHUNK]))
    return out


def replay(costs: np.ndarray, dps: dict, balancers: list, tick=None) -> dict:
    """Every balancer on costs [M, B] (one row per global micro-batch) for each module's DP size.
    Planning time per micro-batch is measured after one untimed first call of each balancer (its
    one-time set-up, reported apart as plan_first_call_ms). tick(n): progress, n micro-batches done
    (M per module for the bound, then M per balancer)."""
    from reorder.plan.grid import canonical_grid
    from reorder.plan.orders import plan_orders, rank_loads

    groups = canonical_grid(list(dps.values()))
    before = {m: rank_loads(costs, None, d) for m, d in dps.items()}
    res = dict(groups=groups, balancers={}, bound={}, spreads={m: {"before": spreads(before[m])} for m in dps})
    for m, d in dps.items():
        strag, bound = before[m].max(axis=1).sum(), _bound(costs, d, tick).sum()
        res["bound"][m] = dict(straggler=float(bound), saved=float(1 - bound / strag) if strag else 0.0)
    for name in balancers:
        t0 = time.perf_counter()
        plan_orders(costs[:1], groups, name)  # the first call pays one-time set-up (tables, caches)
        first_ms = (time.perf_counter() - t0) * 1e3
        orders, spent = np.empty(costs.shape, dtype=np.int64), 0.0
        for k in range(0, len(costs), CHUNK):
            t0 = time.perf_counter()
            orders[k:k + CHUNK] = plan_orders(costs[k:k + CHUNK], groups, name)
            spent += time.perf_counter() - t0
            if tick:
                tick(len(orders[k:k + CHUNK]))
        plan_us = spent * 1e6 / len(costs)
        rows = {}
        for m, d in dps.items():
            after = rank_loads(costs, orders, d)
            sb, sa = float(before[m].max(axis=1).sum()), float(after.max(axis=1).sum())
            sp_b, sp_a = res["spreads"][m]["before"], spreads(after)
            res["spreads"][m][name] = sp_a
            rows[m] = dict(dp=d, straggler_before=sb, straggler_after=sa, saved=1 - sa / sb if sb else 0.0,
                           spread_before=float(sp_b.mean()), spread_after=float(sp_a.mean()),
                           p95_spread_before=float(np.percentile(sp_b, 95)),
                           p95_spread_after=float(np.percentile(sp_a, 95)),
                           moved_fraction=float(orders_moved(orders, d).mean()), plan_us_per_microbatch=plan_us,
                           plan_first_call_ms=first_ms)
        res["balancers"][name] = rows
    return res


def _describe_input(samples: Samples, args) -> str:
    if samples.field == "image_sizes":
        return (f"image_sizes -> patches by Qwen2-VL resize (patch {args.patch_size}, merge {args.merge_size}, "
                f"{args.min_pixels}..{args.max_pixels} pixels)")
    return {"cost": "cost column, used as is", "patches": "patches"}[samples.field]


def _validate(args):
    if (args.input is None) == (args.mix is None):
        raise CliError("give either an input FILE or --mix NAME (not both)")
    if args.mix is not None and args.samples < 1:
        raise CliError(f"--samples {args.samples} is invalid: must be >= 1")
    if args.limit is not None and args.limit < 1:
        raise CliError(f"--limit {args.limit} is invalid: must be >= 1")
    for flag in ("patch_size", "merge_size", "min_pixels", "max_pixels"):
        if getattr(args, flag) < 1:
            raise CliError(f"--{flag.replace('_', '-')} {getattr(args, flag)} is invalid: must be >= 1")
    if args.min_pixels > args.max_pixels:
        raise CliError(f"--min-pixels {args.min_pixels} exceeds --max-pixels {args.max_pixels}")
    from reorder.plan.balancers import BALANCERS

    names = args.balancer or _balancer_names()
    unknown = [n for n in names if n not in BALANCERS]
    if unknown:
        raise CliError(f"unknown balancer(s) {unknown}; choose from {_balancer_names()}")
    check_plot_path(args.plot)
    return list(dict.fromkeys(names))


def check_layout(dps: dict) -> None:
    """Refuse, with the library's own message, a layout that `wrap` refuses (encoder dp > language dp,
    language dp not a multiple of an encoder's): the last module is the language model."""
    from reorder.integrations.config import check_model_layout

    *encoders, (language, dl) = dps.items()
    for name, d in encoders:
        try:
            check_model_layout(encoder_pp=1, encoder_dp=d, language_dp=dl, fixed_width_padding=True)
        except ValueError as e:
            raise CliError(f"{name} dp {d} + {language} dp {dl} is a layout reorder refuses: {e}") from None


def _progress(args, total: int):
    """A progress bar on stderr that shows only once the run has taken `--progress-after` seconds (None
    without tqdm); it counts micro-batches planned (the bound per module, then each balancer)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="planning", unit="mb", delay=args.progress_after, leave=False,
                file=sys.stderr, dynamic_ncols=True)


def run(args) -> dict:
    from reorder.plan.grid import canonical_grid

    if getattr(args, "calibrate", None):
        if args.input is not None or args.mix is not None:
            raise CliError("--calibrate LOG reports a logged run's calibration: give no input FILE or --mix with it")
        from reorder.cli import calibration_log

        return calibration_log.run(args)
    balancers = _validate(args)
    dps = layout_from_args(args)
    check_layout(dps)
    groups = canonical_grid(list(dps.values()))
    B = args.micro_batch
    if B < 1 or B % groups:
        raise CliError(f"--micro-batch {B} is not a positive multiple of the canonical grid "
                       f"G = lcm({', '.join(map(str, dps.values()))}) = {groups}")
    out = human_stream(args)
    samples = synthetic_samples(args.mix, args.samples, args.seed) if args.mix else load_file(args.input, args)
    costs = sample_costs(samples, args)
    if args.limit is not None:
        costs = costs[:args.limit]
    n = len(costs)
    m = n // B
    if m == 0:
        raise CliError(f"{samples.source}: {n} samples, fewer than one micro-batch of B={B}")
    used = costs[:m * B]
    bar = _progress(args, m * (len(dps) + len(balancers)))
    try:
        res = replay(used.reshape(m, B), dps, balancers, tick=None if bar is None else bar.update)
    finally:
        if bar is not None:
            bar.close()
    layout = " + ".join(f"{k} dp {d}" for k, d in dps.items())
    q = _print_input(out, samples, args, n, used, layout, groups)
    _print_results(out, res, balancers, groups)
    data = dict(input=dict(source=samples.source, field=samples.field, samples=n, used=m * B, dropped=n - m * B),
                layout=dps, groups=groups, micro_batch=B, micro_batches=m,
                cost=dict(encoder_weight=args.encoder_weight, language_weight=args.language_weight,
                          mean=float(used.mean()), median=float(q[0]), p95=float(q[1]), max=float(used.max())),
                resize=dict(patch_size=args.patch_size, merge_size=args.merge_size, min_pixels=args.min_pixels,
                            max_pixels=args.max_pixels) if samples.field == "image_sizes" else None,
                balancers=res["balancers"], bound=res["bound"])
    if args.plot:
        make_plot("plot_simulation", args.plot, dict(modules=dps, balancers=res["balancers"], bound=res["bound"],
                                                spreads=res["spreads"]),
                  f"reorder simulate: {samples.source}, {plural(m, 'micro-batch')} of B={B}, {layout}")
        print(f"plot written to {args.plot}", file=out)
    write_json(args.json, data)
    return data


def _print_input(out, samples: Samples, args, n: int, used: np.ndarray, layout: str, groups: int):
    """The run's first lines (what was read, how it was cut, the cost distribution); returns the
    cost's median and p95."""
    B = args.micro_batch
    m = len(used) // B
    print(f"reorder simulate: {samples.source}: {n} samples ({_describe_input(samples, args)}); "
          f"{plural(m, 'micro-batch')} of B={B} in file order"
          + (f", {plural(n - m * B, 'trailing sample')} dropped" if n > m * B else ""), file=out)
    q = np.percentile(used, [50, 95]) if len(used) else (0, 0)
    print(f"per-sample cost: mean {used.mean():.0f}, median {q[0]:.0f}, p95 {q[1]:.0f}, max {used.max():.0f}, "
          f"zero-cost (text-only) {np.mean(used == 0):.0%}; layout {layout}, canonical grid G={groups}", file=out)
    return q


def _print_results(out, res: dict, balancers: list, groups: int) -> None:
    """The table of every balancer and module, the notes on modules made worse, and the legend."""
    print(f"\n{'balancer':10} {'module':9} {'dp':>3} {'straggler before':>17} {'after':>12} {'saved':>7} "
          f"{'bound':>6} {'spread before -> after':>22} {'p95 after':>9} {'moved':>6} {'plan us/mb':>10}", file=out)
    for name in balancers:
        for mod, r in res["balancers"][name].items():
            print(f"{name:10} {mod:9} {r['dp']:3d} {r['straggler_before']:17.0f} {r['straggler_after']:12.0f} "
                  f"{r['saved']:7.1%} {res['bound'][mod]['saved']:6.1%} {r['spread_before']:10.3f} -> "
                  f"{r['spread_after']:8.3f} {r['p95_spread_after']:9.3f} {r['moved_fraction']:6.1%} "
                  f"{r['plan_us_per_microbatch']:10.1f}", file=out)
    for name in balancers:
        for mod, r in res["balancers"][name].items():
            note = worse_note(mod, r["dp"], r["saved"], name, groups)
            if note:
                print(note, file=out)
    print("\nstraggler = sum over micro-batches of the max per-rank cost (before: the natural contiguous split); "
          "saved = 1 - after/before\nbound = the most any equal-count split of the module's ranks could save (one "
          "plan over G groups serves every module)\nspread = max/mean per-rank cost, mean over micro-batches (p95 "
          "after: its 95th percentile); moved = samples that change rank", file=out)
    first = ", ".join(f"{name} {next(iter(res['balancers'][name].values()))['plan_first_call_ms']:.1f} ms"
                      for name in balancers)
    print(f"plan us/mb = planning time per micro-batch after each balancer's first call, which pays a one-time "
          f"set-up ({first})", file=out, flush=True)
