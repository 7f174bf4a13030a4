"""The batch layer on a GPU: counting and describing micro-batches whose tensors live on the device,
on the host, or split between them, against the same micro-batches all on the host.

For random synthetic Qwen-VL micro-batches, with and without the quadratic count: `count_samples`
with input_ids / attention_mask on the device or the host and grid_thw on the device, the host or
absent (the Triton counting kernel where input_ids are on the device, else numpy); `describe` of the
micro-batch on the device, with and without image counts and grid_thw handed over from the host.
Every count, grid_thw and layout must equal the host's, the counting kernel must still be in use at
the end, and nothing may be logged (a kernel that failed and fell back would be).

  python functional_tests/batch_cuda.py [--micro-batches 24]
  python functional_tests/batch_cuda.py --device cpu      # rehearsal on the CPU

Prints one RESULT line (a dict with ok) and exits 1 on any difference. The CUDA-only mutants of
counting.py and layout.py are judged with it (ci/mutation_gpu.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reorder import CostModel  # noqa: E402
from reorder.batch import counting  # noqa: E402
from reorder.batch.layout import describe, grid_thw_of  # noqa: E402
from reorder.cli import synthetic as syn  # noqa: E402


class Logged(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--micro-batches", type=int, default=24)
    p.add_argument("--device", default="cuda", help="cpu: a rehearsal, every placement on the host")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    logged = Logged()
    logging.getLogger("reorder").addHandler(logged)
    rng = np.random.default_rng(5)
    diffs, checked = [], 0
    for k in range(a.micro_batches):
        host = syn.make_global_batch(rng, 4, 512, features=4, mix="small", first_id=4 * k)
        ids, mask, thw = host["input_ids"], host["attention_mask"], grid_thw_of(host)
        for squares in (False, True):
            cost = CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START,
                             encoder_quadratic_weight=1e-6 if squares else 0.0)
            want, want_thw = counting.count_samples(cost, ids, mask, grid_thw=thw)
            for ids_on in ("cpu", dev):
                for thw_on in ("cpu", dev, None):
                    got, got_thw = counting.count_samples(
                        cost, ids.to(ids_on), mask.to(ids_on),
                        grid_thw=None if thw_on is None else thw.to(thw_on))
                    checked += 1
                    if not np.array_equal(got, want) or (thw_on is not None and not np.array_equal(got_thw, want_thw)):
                        diffs.append(f"count_samples: micro-batch {k}, squares {squares}, input_ids on {ids_on}, "
                                     f"grid_thw on {thw_on}")
        want_layout, want_shard = describe(host, 4, vision_start_token_id=syn.VISION_START)
        on_dev = syn.to_device(host, dev)
        counts = (ids == syn.VISION_START).sum(dim=1).numpy()
        for image_counts, thw_host in ((None, None), (counts, None), (None, thw.numpy()), (counts, thw.numpy())):
            layout, shard = describe(on_dev, 4, vision_start_token_id=syn.VISION_START, image_counts=image_counts,
                                     grid_thw_host=thw_host)
            checked += 1
            if layout != want_layout or not np.array_equal(shard.row_counts, want_shard.row_counts) or \
                    not np.array_equal(shard.image_counts, want_shard.image_counts):
                diffs.append(f"describe: micro-batch {k}, image counts given {image_counts is not None}, "
                             f"grid_thw from the host {thw_host is not None}")
    kernel = dev.type != "cuda" or bool(counting._KERNEL) and counting._KERNEL[0] is not None
    result = {"ok": not diffs and kernel and not logged.records, "checked": checked, "differences": diffs[:5],
              "counting_kernel": kernel, "logged": logged.records[:3]}
    print("RESULT", result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
