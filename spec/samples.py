"""Slow per-sample view of a micro-batch for invariant checks: sample i -> {field: raw bytes}.

Walks the batch one sample at a time (plain loops, torch only for reading bytes). A sample owns
row i of every batch-dim-0 tensor, column i of MRoPE position_ids [3, B, S], entry i of every
length-B list, and its images (counted by vision-start tokens in its input_ids row, in order) with
their patch rows (prod(grid_thw) each) of every per-row vision tensor.
"""

from __future__ import annotations

import pickle


def _raw(t):
    t = t.contiguous()
    return bytes(t.view(-1).view(__import__("torch").uint8).numpy()) if t.numel() else b""


def per_sample_bytes(batch, *, vision_start_token_id):
    ids = batch["input_ids"]
    n = ids.shape[0]
    out = [dict() for _ in range(n)]
    for key, v in batch.items():
        if key == "modality_inputs":
            continue
        if isinstance(v, list) and len(v) == n:
            for i in range(n):
                out[i][key] = pickle.dumps(v[i])
            continue
        dim = 1 if key == "position_ids" and v.dim() == 3 else 0
        if v.dim() > dim and v.shape[dim] == n:
            for i in range(n):
                out[i][key] = _raw(v.select(dim, i))
    for enc_name, enc in batch.get("modality_inputs", {}).get("images", {}).items():
        thw = enc["grid_thw"].tolist()
        counts = [sum(1 for t in ids[i].tolist() if t == vision_start_token_id) for i in range(n)]
        img = row = 0
        for i in range(n):
            rows = 0
            for k in range(img, img + counts[i]):
                rows += thw[k][0] * thw[k][1] * thw[k][2]
            for key, v in enc.items():
                if key == "grid_thw" or (key != "hidden_states" and v.shape[0] == len(thw)):
                    out[i][f"{enc_name}/{key}"] = _raw(v[img:img + counts[i]])
                else:
                    out[i][f"{enc_name}/{key}"] = _raw(v[row:row + rows])
            img += counts[i]
            row += rows
    return out
