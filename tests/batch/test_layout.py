"""The batch layout (`reorder.batch.layout`) against batches built here from a plain description
(per sample: its images' t, h, w; per field: its dtype and shape): what `describe` finds per
sample (fields, batch dims, row and image counts, per-row / per-image / either kinds), the errors
that name what to fix, layout signatures and how ranks and micro-batches agree on one layout."""

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reorder.batch.layout import (BatchLayout, LayoutError, Shard, describe, first_difference, grid_thw_of,
                                  rebuild, tensors, unify, window_layout)
from spec.samples import per_sample_bytes

VS = 5          # vision-start token id
ENC = ("modality_inputs", "images", "vit")


def build(images, *, seq=12, features=3, extra_image=None, extra_row=None, grid_dtype=torch.int64):
    """A micro-batch of len(images) samples; images[s]: the (t, h, w) of sample s's images. input_ids
    holds one vision-start token per image; hidden_states one row per patch (t*h*w per image);
    extra_image / extra_row: more per-image / per-row vision fields {name: trailing shape}."""
    b = len(images)
    ids = torch.zeros(b, seq, dtype=torch.int64)
    for s, imgs in enumerate(images):
        ids[s, :len(imgs)] = VS
    thw = [list(x) for imgs in images for x in imgs]
    rows = sum(t * h * w for t, h, w in thw)
    vit = {"hidden_states": torch.arange(rows * features, dtype=torch.float32).reshape(rows, features),
           "grid_thw": torch.tensor(thw, dtype=grid_dtype).reshape(-1, 3)}
    for name, shape in (extra_image or {}).items():
        vit[name] = torch.arange(len(thw) * int(np.prod(shape)), dtype=torch.int32).reshape(len(thw), *shape)
    for name, shape in (extra_row or {}).items():
        vit[name] = torch.arange(rows * int(np.prod(shape)), dtype=torch.int16).reshape(rows, *shape)
    return {"input_ids": ids, "labels": ids + 1, "modality_inputs": {"images": {"vit": vit}}}


def kinds(layout):
    return {f.path[-1]: f.per for f in layout.ragged}


@st.composite
def image_lists(draw, max_samples=4):
    return draw(st.lists(st.lists(st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 3)), max_size=3),
                         min_size=1, max_size=max_samples))


# --- describe: what a sample owns ----------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(image_lists())
def test_describe_counts_each_samples_images_and_rows(images):
    batch = build(images, extra_image={"sizes": (2,)}, extra_row={"pos": (2,)})
    layout, shard = describe(batch, len(images), vision_start_token_id=VS)
    assert shard.image_counts.tolist() == [len(imgs) for imgs in images]
    assert shard.row_counts.tolist() == [sum(t * h * w for t, h, w in imgs) for imgs in images]
    assert shard.row_counts.dtype == np.int64 and shard.image_counts.dtype == np.int64
    assert shard.n == len(images)
    assert layout.grid_thw_path == ENC + ("grid_thw",)
    n_img, rows = sum(map(len, images)), sum(t * h * w for imgs in images for t, h, w in imgs)
    want = {"hidden_states": "row", "pos": "row", "grid_thw": "image", "sizes": "image"}
    if n_img == rows:   # one patch row per image: only hidden_states says per row
        want.update(sizes="any", pos="any")
    assert kinds(layout) == want
    # what the shard holds is what the spec's per-sample walk gives, sample by sample
    out = rebuild(batch, layout, shard)
    assert per_sample_bytes(out, vision_start_token_id=VS) == per_sample_bytes(batch, vision_start_token_id=VS)


def test_grid_thw_is_per_image_even_with_one_patch_row_per_image():
    layout, _ = describe(build([[(1, 1, 1)], [(1, 1, 1), (1, 1, 1)]], extra_image={"sizes": (2,)}), 2,
                         vision_start_token_id=VS)
    assert kinds(layout) == {"hidden_states": "row", "grid_thw": "image", "sizes": "any"}


def test_hidden_states_is_per_row_whatever_its_length():
    """hidden_states with as many entries as images (not rows) is refused, never read as per image."""
    batch = build([[(1, 2, 2)], [(1, 1, 2)]])
    batch["modality_inputs"]["images"]["vit"]["hidden_states"] = torch.zeros(2, 3)
    with pytest.raises(LayoutError) as e:
        describe(batch, 2, vision_start_token_id=VS)
    assert str(e.value) == ("field 'modality_inputs/images/vit/hidden_states' has 2 rows but grid_thw sums to "
                            "6 patch rows over 2 images")


def test_a_one_dimensional_per_image_field():
    batch = build([[(1, 2, 2)], [(1, 1, 2), (1, 1, 1)]])
    batch["modality_inputs"]["images"]["vit"]["image_ids"] = torch.tensor([7, 8, 9])
    layout, shard = describe(batch, 2, vision_start_token_id=VS)
    assert kinds(layout)["image_ids"] == "image"
    assert shard.ragged[ENC + ("image_ids",)].tolist() == [7, 8, 9]


def test_vision_fields_three_keys_deep():
    """modality_inputs/<encoder>/<field>: one encoder dict directly under modality_inputs."""
    batch = build([[(1, 2, 1)], []])
    batch["modality_inputs"] = {"vit": batch["modality_inputs"]["images"]["vit"]}
    layout, shard = describe(batch, 2, vision_start_token_id=VS)
    assert layout.grid_thw_path == ("modality_inputs", "vit", "grid_thw")
    assert [f.path for f in layout.dense] == [("input_ids",), ("labels",)]    # the vision fields are not dense
    assert {f.path: f.per for f in layout.ragged} == {("modality_inputs", "vit", "hidden_states"): "row",
                                                      ("modality_inputs", "vit", "grid_thw"): "image"}
    assert shard.row_counts.tolist() == [2, 0]


def test_a_two_key_field_under_modality_inputs_and_deep_text_fields_are_dense():
    b = 3
    batch = {"input_ids": torch.zeros(b, 4, dtype=torch.int64), "modality_inputs": {"flags": torch.ones(b, 2)},
             "text": {"deeper": {"ids": torch.arange(b * 5).reshape(b, 5)}}}
    layout, shard = describe(batch, b, vision_start_token_id=VS)
    assert [f.path for f in layout.dense] == [("input_ids",), ("modality_inputs", "flags"), ("text", "deeper", "ids")]
    assert layout.ragged == () and layout.grid_thw_path is None
    assert shard.row_counts is None and shard.image_counts is None


def test_batch_dims_and_metadata():
    """position_ids of rank 3 (MRoPE) are per sample along dim 1, of rank 2 along dim 0; batch_dims
    names other dims; a tensor whose batch dim does not hold B samples is global metadata (and the
    fields after it are still read)."""
    b, s = 3, 5
    batch = {"input_ids": torch.zeros(b, s, dtype=torch.int64), "meta": torch.zeros(7, 2),
             "position_ids": torch.arange(b * s).reshape(b, s), "mrope": {"position_ids": torch.zeros(3, b, s)},
             "x": torch.zeros(2, b), "step": torch.tensor(4), "note": ["a", "b", "c"], "short": ["a"]}
    layout, shard = describe(batch, b, vision_start_token_id=VS, batch_dims={"x": 1})
    dims = {f.path: (f.batch_dim, f.sample_shape) for f in layout.dense}
    assert dims == {("input_ids",): (0, (s,)), ("position_ids",): (0, (s,)), ("mrope", "position_ids"): (1, (3, s)),
                    ("x",): (1, (2,))}
    assert layout.lists == (("note",),) and shard.lists == [("a",), ("b",), ("c",)]
    assert rebuild(batch, layout, shard)["meta"] is batch["meta"]


@pytest.mark.parametrize("name", ["labels", "loss_mask", "attention_mask", "position_ids"])
def test_a_per_sample_field_with_another_batch_size_is_refused(name):
    batch = {"input_ids": torch.zeros(4, 6, dtype=torch.int64), name: torch.zeros(3, 6)}
    with pytest.raises(LayoutError) as e:
        describe(batch, 4, vision_start_token_id=VS)
    assert str(e.value) == f"field '{name}' has shape (3, 6): expected 4 samples along dim 0"


def test_batch_dims_name_a_dim_that_must_hold_the_samples():
    batch = {"input_ids": torch.zeros(4, 6, dtype=torch.int64), "x": {"y": torch.zeros(4, 2)}}
    for dim, shape in ((1, (4, 2)), (2, (4, 2))):
        with pytest.raises(LayoutError) as e:
            describe(batch, 4, vision_start_token_id=VS, batch_dims={"y": dim})
        assert str(e.value) == f"field 'x/y' has shape {shape}: expected 4 samples along dim {dim}"


def test_input_ids_errors():
    with pytest.raises(LayoutError) as e:
        describe([torch.zeros(2, 2)], 2, vision_start_token_id=VS)
    assert str(e.value) == "micro-batch is a list: expected a dict of fields"
    with pytest.raises(LayoutError) as e:
        describe({"input_ids": torch.zeros(2, 3, 4)}, 2, vision_start_token_id=VS)
    assert str(e.value) == "field 'input_ids' must be a [B, S] tensor on every rank: the cost is computed from it"
    with pytest.raises(LayoutError) as e:
        describe({"input_ids": torch.zeros(3, 7, dtype=torch.int64)}, 2, vision_start_token_id=VS)
    assert str(e.value) == "field 'input_ids' has 3 samples, expected B/dp=2"


def test_a_key_that_is_not_a_string():
    with pytest.raises(LayoutError) as e:
        describe({"input_ids": torch.zeros(2, 3), 7: torch.zeros(2)}, 2, vision_start_token_id=VS)
    assert str(e.value) == "batch key 7 at <root> is not a string"
    batch = build([[(1, 1, 1)], []])
    batch["modality_inputs"]["images"]["vit"][(1, 2)] = torch.zeros(1)
    with pytest.raises(LayoutError) as e:
        describe(batch, 2, vision_start_token_id=VS)
    assert str(e.value) == "batch key (1, 2) at modality_inputs/images/vit is not a string"


def test_grid_thw_errors():
    batch = build([[(1, 1, 2)], []])
    vit = batch["modality_inputs"]["images"]["vit"]
    path = "modality_inputs/images/vit/grid_thw"
    for bad in (vit["grid_thw"].reshape(-1), vit["grid_thw"][:, :2], torch.zeros(1, 4, dtype=torch.int64),
                vit["grid_thw"].tolist()):
        vit["grid_thw"] = bad
        with pytest.raises(LayoutError) as e:
            describe(batch, 2, vision_start_token_id=VS)
        assert str(e.value) == f"field '{path}' must be an [n_images, 3] tensor"
    vit["grid_thw"] = torch.ones(2, 3, dtype=torch.int64)
    with pytest.raises(LayoutError) as e:
        describe(batch, 2, vision_start_token_id=VS)
    assert str(e.value) == (f"field '{path}' has 2 images but input_ids holds 1 vision-start tokens (id {VS}): "
                            "image counts are mis-sourced or vision_start_token_id is wrong")
    for found in (0, 2):
        b2 = build([[(1, 1, 2)], []])
        vit2 = b2["modality_inputs"]["images"]["vit"]
        if found == 0:
            vit2["thw"] = vit2.pop("grid_thw")
        else:
            b2["modality_inputs"]["images"]["other"] = {"grid_thw": vit2["grid_thw"]}
        with pytest.raises(LayoutError) as e:
            describe(b2, 2, vision_start_token_id=VS)
        assert str(e.value) == (f"modality_inputs must hold exactly one 'grid_thw' tensor, found {found}: reorder "
                                "supports one vision encoder per batch")


@settings(max_examples=30, deadline=None)
@given(image_lists(max_samples=5), st.data())
def test_a_grid_thw_component_below_one_names_sample_and_image(images, data):
    """The first image (in batch order) with a t, h or w below 1 is named by its sample and its index
    in that sample, with the micro-batch's `where` first; images before it may have components of 1."""
    n_img = sum(map(len, images))
    if not n_img:
        return
    bad = data.draw(st.integers(0, n_img - 1))
    batch = build(images)
    vit = batch["modality_inputs"]["images"]["vit"]
    thw = vit["grid_thw"].clone()
    comp = data.draw(st.integers(0, 2))
    thw[bad, comp] = data.draw(st.sampled_from([0, -1]))
    if data.draw(st.booleans()) and bad + 1 < n_img:
        thw[bad + 1:, 0] = 0   # later images may be bad too: the first is named
    vit["grid_thw"] = thw
    sample = next(s for s in range(len(images)) if sum(map(len, images[:s + 1])) > bad)
    where = data.draw(st.sampled_from([None, "", "micro-batch 2 "]))
    with pytest.raises(LayoutError) as e:
        if where is None:                       # not given: nothing before "sample"
            describe(batch, len(images), vision_start_token_id=VS)
        else:
            describe(batch, len(images), vision_start_token_id=VS, where=where)
    where = where or ""
    assert str(e.value) == (f"{where}sample {sample} image {bad - sum(map(len, images[:sample]))}: grid_thw "
                            f"{thw[bad].tolist()} has a component < 1: every t, h, w must be an integer >= 1 "
                            "(field 'modality_inputs/images/vit/grid_thw')")


def test_vision_field_errors():
    batch = build([[(1, 1, 2)], []])
    batch["modality_inputs"]["images"]["audio"] = {"x": torch.zeros(2, 1)}
    with pytest.raises(LayoutError) as e:
        describe(batch, 2, vision_start_token_id=VS)
    assert str(e.value) == ("field 'modality_inputs/images/audio/x': only one vision encoder dict is supported "
                            "(found 'modality_inputs/images/vit' too)")
    for bad in ([1, 2], torch.tensor(3.0)):
        batch = build([[(1, 1, 2)], []])
        batch["modality_inputs"]["images"]["vit"]["extra"] = bad
        with pytest.raises(LayoutError) as e:
            describe(batch, 2, vision_start_token_id=VS)
        assert str(e.value) == ("field 'modality_inputs/images/vit/extra' must be a tensor with a leading row or "
                                "image dim")
    batch = build([[(1, 1, 2)], [(1, 1, 1)]])
    batch["modality_inputs"]["images"]["vit"]["extra"] = torch.zeros(5, 1)
    with pytest.raises(LayoutError) as e:
        describe(batch, 2, vision_start_token_id=VS)
    assert str(e.value) == "field 'modality_inputs/images/vit/extra' has 5 rows but grid_thw sums to 3 patch rows over 2 images"


def test_image_counts_and_grid_thw_given_on_the_host_are_what_describe_reads():
    """Counts and grid_thw the caller already holds on the host are used as given: grid_thw itself
    may then live where it cannot be read (here: the meta device), and input_ids are not recounted."""
    images = [[(1, 2, 2)], [(1, 1, 2), (1, 1, 1)]]
    batch = build(images)
    vit = batch["modality_inputs"]["images"]["vit"]
    host = vit["grid_thw"].numpy().copy()
    vit["grid_thw"] = vit["grid_thw"].to("meta")
    batch["input_ids"] = torch.zeros_like(batch["input_ids"])     # no vision-start token left to count
    layout, shard = describe(batch, 2, vision_start_token_id=VS, image_counts=np.array([1, 2]), grid_thw_host=host)
    assert shard.image_counts.tolist() == [1, 2] and shard.row_counts.tolist() == [4, 3]


def test_rows_of_large_images_are_counted_in_int64():
    """t*h*w of an int32 grid_thw above 2**31 (per-image fields only): rows counted without overflow."""
    thw = [(1, 50000, 50000), (2, 40000, 40000)]
    batch = {"input_ids": torch.tensor([[VS, 0], [VS, 0]]),
             "modality_inputs": {"images": {"vit": {"grid_thw": torch.tensor(thw, dtype=torch.int32),
                                                    "sizes": torch.zeros(2, 2)}}}}
    layout, shard = describe(batch, 2, vision_start_token_id=VS)
    assert shard.row_counts.tolist() == [t * h * w for t, h, w in thw]


def test_grid_thw_of():
    batch = build([[(1, 1, 2)], []])
    assert grid_thw_of(batch) is batch["modality_inputs"]["images"]["vit"]["grid_thw"]
    assert grid_thw_of({"input_ids": torch.zeros(2, 2)}) is None
    assert grid_thw_of([batch]) is None
    batch["modality_inputs"]["images"]["other"] = {"grid_thw": torch.zeros(1, 3)}
    assert grid_thw_of(batch) is None
    batch = build([[(1, 1, 2)], []])
    batch["modality_inputs"]["images"]["vit"]["grid_thw"] = [[1, 1, 2]]
    assert grid_thw_of(batch) is None


def test_tensors_walks_nested_containers_depth_first():
    a, b, c, d = (torch.tensor(i) for i in range(4))
    assert [int(t) for t in tensors({"x": a, "y": [b, {"z": (c,)}], "w": "text", "v": d})] == [0, 1, 2, 3]


def test_list_blobs():
    s = Shard(n=3)
    assert s.list_blobs() == [b""] * 3
    s.lists = [("a", 1), ("b", 2), ("c", [3])]
    assert [pickle.loads(x) for x in s.list_blobs()] == s.lists


# --- signatures, and one layout across ranks and micro-batches ---------------------------------

def test_signature_names_every_field():
    b = 2
    batch = build([[(1, 1, 2)], [(1, 2, 1)]], extra_image={"sizes": (2,)})
    batch["position_ids"] = torch.zeros(3, b, 12, dtype=torch.int32)
    batch["text"] = {"mask": torch.zeros(b, 12, dtype=torch.bool)}
    batch["note"] = ["x", "y"]
    batch["meta"] = {"ids": ["a", "b"]}
    layout, _ = describe(batch, b, vision_start_token_id=VS)
    v = "modality_inputs/images/vit"
    assert layout.signature() == ";".join([
        "input_ids:d0:int64:[12]", "labels:d0:int64:[12]", "position_ids:d1:int32:[3, 12]", "text/mask:d0:bool:[12]",
        f"{v}/hidden_states:row:float32:[3]", f"{v}/grid_thw:image:int64:[3]", f"{v}/sizes:image:int32:[2]",
        "note:list", "meta/ids:list"])


def any_layout():
    """A layout whose pixel rows and per-image sizes are left "any" (one patch row per image)."""
    layout, _ = describe(build([[(1, 1, 1)], [(1, 1, 1)]], extra_image={"sizes": (2,)}, extra_row={"pix": (2,)}), 2,
                         vision_start_token_id=VS)
    return layout


def test_adopting_and_resolved():
    layout = any_layout()
    assert kinds(layout) == {"hidden_states": "row", "grid_thw": "image", "sizes": "any", "pix": "any"}
    pix, sizes = ENC + ("pix",), ENC + ("sizes",)
    assert kinds(layout.adopting({})) == kinds(layout)
    assert kinds(layout.adopting({pix: "row"})) == {**kinds(layout), "pix": "row"}
    assert kinds(layout.adopting({pix: "row"}, rest="image")) == {**kinds(layout), "pix": "row", "sizes": "image"}
    assert kinds(layout.resolved({sizes: "image"})) == {**kinds(layout), "pix": "row", "sizes": "image"}
    assert layout.adopting({pix: "row"}).grid_thw_path == layout.grid_thw_path
    resolved = layout.resolved()
    assert resolved.adopting({pix: "image"}) is resolved                      # nothing left "any"
    only_any = BatchLayout((), tuple(f for f in layout.ragged if f.per == "any"), (), None)
    assert kinds(only_any.adopting({pix: "row", sizes: "image"})) == {"pix": "row", "sizes": "image"}


def test_unify():
    layout = any_layout()
    pix, sizes = ENC + ("pix",), ENC + ("sizes",)
    s = layout.signature()
    row = layout.adopting({pix: "row", sizes: "image"}).signature()
    image = layout.adopting({pix: "image"}).signature()
    assert unify([s, s, None]) == {} and unify([None]) == {}
    assert unify([s, row, None, s]) == {pix: "row", sizes: "image"}
    assert unify([image, s]) == {pix: "image"}
    assert unify([row, image]) is None                            # per row on one, per image on another
    fewer = ";".join(s.split(";")[:-1])
    assert unify([s, fewer]) is None and unify([fewer, s]) is None
    other = s.replace("sizes:any:int32", "sizes:any:int64")
    assert unify([s, other]) is None


def test_window_layout():
    layout = any_layout()
    pix = ENC + ("pix",)
    row = layout.adopting({pix: "row"})
    assert window_layout([layout, layout]) is layout
    assert window_layout([layout, row]) == row and window_layout([row, layout]) == row
    other = BatchLayout(layout.dense[:1], layout.ragged, layout.lists, layout.grid_thw_path)
    with pytest.raises(LayoutError) as e:
        window_layout([layout, row, other])
    assert str(e.value) == ("micro-batch 2 of the window: field 'labels' is absent, micro-batch 0 has int64 [12] "
                            "(batch dim 0): every micro-batch must carry the same fields, dtypes and per-sample "
                            "shapes (pad to a fixed sequence length)")


def test_first_difference_in_words():
    layout = any_layout()
    s = layout.signature() + ";note:list"
    image = layout.adopting({ENC + ("pix",): "image"}).signature()
    path = "modality_inputs/images/vit/pix"
    assert first_difference([s, image]) == (path, ["int16 [2] per row or image", "int16 [2] per image"])
    assert first_difference([s, None]) == ("input_ids", ["int64 [12] (batch dim 0)", "absent"])
    assert first_difference([image, s]) == (path, ["int16 [2] per image", "int16 [2] per row or image"])
    no_list = s.rsplit(";", 1)[0]
    assert first_difference([no_list, s]) == ("note", ["absent", "a per-sample list"])
