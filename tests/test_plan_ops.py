"""Op records and box arithmetic: byte runs, contiguity, merging, coalescing, the columnar table
and the on-disk form of a plan."""

from __future__ import annotations

import numpy as np
import pytest

from tests.plan_fakes import fake_inputs
from tests.plan_helpers import ops_to_table, write_runs
from weightsync.plan.api import build_plan
from weightsync.plan.ops import CopyOp, box_is_contiguous, box_runs, coalesce_ops, merge_boxes
from weightsync.plan.serialize import cached_plan, load_plan, plan_from_dict, plan_to_dict, save_plan


def _runs_by_enumeration(shape, box, itemsize):
    """Oracle: every element's byte offset, grouped into maximal runs."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    idx = np.stack(np.meshgrid(*[np.arange(a, b) for a, b in box], indexing="ij"), -1).reshape(-1, len(shape))
    offs = sorted(int(x) for x in (idx * strides).sum(1))
    runs = []
    for o in offs:
        if runs and runs[-1][0] + runs[-1][1] == o:
            runs[-1][1] += 1
        else:
            runs.append([o, 1])
    return [(o * itemsize, n * itemsize) for o, n in runs]


@pytest.mark.parametrize(
    ("shape", "box", "itemsize"),
    [
        pytest.param((8, 16), ((0, 8), (0, 16)), 2, id="whole-tensor"),
        pytest.param((8, 16), ((2, 5), (0, 16)), 2, id="full-rows"),
        pytest.param((8, 16), ((2, 5), (4, 12)), 2, id="column-block"),
        pytest.param((8, 16), ((3, 4), (4, 12)), 1, id="one-row-part"),
        pytest.param((4, 6, 8), ((1, 2), (0, 6), (0, 8)), 4, id="one-expert"),
        pytest.param((4, 6, 8), ((1, 3), (2, 4), (0, 8)), 2, id="experts-rows"),
        pytest.param((4, 6, 8), ((0, 4), (0, 6), (3, 5)), 2, id="inner-columns"),
        pytest.param((10,), ((3, 7),), 2, id="vector"),
    ],
)
def test_box_runs_match_element_enumeration(shape, box, itemsize):
    runs = box_runs(shape, box, itemsize)
    assert runs == _runs_by_enumeration(shape, box, itemsize)
    assert box_is_contiguous(shape, box) == (len(runs) == 1)


def test_box_runs_collapse_trailing_full_dims():
    assert box_runs((4, 6, 8), ((1, 3), (0, 6), (0, 8)), 2) == [(96, 192)]
    assert box_runs((8, 16), ((0, 8), (0, 0)), 2) == []


@pytest.mark.parametrize(
    ("x", "y", "want"),
    [
        pytest.param(((0, 4), (0, 8)), ((4, 6), (0, 8)), (((0, 6), (0, 8)), -2), id="rows"),
        pytest.param(((0, 4), (0, 8)), ((0, 4), (8, 9)), (((0, 4), (0, 9)), -1), id="cols"),
        pytest.param(((0, 4), (0, 8)), ((5, 6), (0, 8)), None, id="gap"),
        pytest.param(((0, 4), (0, 8)), ((4, 6), (0, 7)), None, id="unequal-elsewhere"),
        pytest.param(((0, 4), (0, 8)), ((0, 4), (0, 8)), None, id="same"),
    ],
)
def test_merge_boxes(x, y, want):
    assert merge_boxes(x, y) == want


def _op(g, s, d, **kw):
    base = {"global_name": "w", "src_rank": 0, "src_param": "a", "dst_rank": 1, "dst_param": "b", "transform": None,
            "zero_copy": False}
    base.update(kw)
    return CopyOp(global_box=g, src_box=s, dst_box=d, **base)


def test_coalesce_ops_merges_only_consistent_neighbours():
    ops = [
        _op(((0, 2), (0, 8)), ((4, 6), (0, 8)), ((0, 1), (0, 2), (0, 8))),
        _op(((2, 4), (0, 8)), ((6, 8), (0, 8)), ((0, 1), (2, 4), (0, 8))),
        _op(((4, 6), (0, 8)), ((0, 2), (0, 8)), ((0, 1), (4, 6), (0, 8))),  # source not adjacent
        _op(((6, 8), (0, 8)), ((8, 10), (0, 8)), ((0, 1), (6, 8), (0, 8)), src_param="other"),
    ]
    out = coalesce_ops(ops, lambda rank, name: (10, 8))
    assert len(out) == 3
    merged = [o for o in out if o.global_box == ((0, 4), (0, 8))]
    assert merged
    assert merged[0].src_box == ((4, 8), (0, 8))
    assert merged[0].dst_box == ((0, 1), (0, 4), (0, 8))
    assert merged[0].zero_copy  # rows 4..8 of a (10, 8) tensor are one run


def test_write_runs_pair_and_merge_byte_runs():
    # gate rows then up rows of one fused source into one stacked destination: one run after merging
    ops = [
        _op(((0, 2), (0, 4)), ((0, 2), (0, 4)), ((0, 1), (0, 2), (0, 4)), global_name="gate"),
        _op(((0, 2), (0, 4)), ((2, 4), (0, 4)), ((0, 1), (2, 4), (0, 4)), global_name="up"),
    ]
    shapes_src = {(0, "a"): (4, 4)}
    shapes_dst = {(1, "b"): (3, 4, 4)}
    runs = write_runs(ops, shapes_src, shapes_dst, {(0, "a"): 2})
    assert runs == [(0, 0, 32)]


def test_op_table_round_trip():
    plan = build_plan(fake_inputs(), "p2p")
    ops = plan.ops
    table = ops_to_table(ops)
    assert table.ops() == ops
    assert [table.op(i) for i in range(len(table))] == ops


def test_plan_serialization_round_trip(tmp_path):
    for mode in ("p2p", "broadcast"):
        plan = build_plan(fake_inputs(), mode)
        path = tmp_path / f"{mode}.npz"
        save_plan(plan, path)
        back = load_plan(path)
        assert back.ops == plan.ops
        assert back.mode == mode
        assert back.sender_bytes == plan.sender_bytes
        assert back.receiver_bytes == plan.receiver_bytes
        assert back.buckets == plan.buckets
        assert back.gather_bytes == plan.gather_bytes
        again = plan_from_dict(plan_to_dict(plan))
        assert again.ops == plan.ops


def test_cached_plan_hits_on_second_call(tmp_path):
    inputs = fake_inputs()
    calls = []

    def build():
        calls.append(1)
        return build_plan(inputs, "p2p")

    key = inputs.cache_key("p2p")
    first, hit1 = cached_plan(build, key, tmp_path)
    second, hit2 = cached_plan(build, key, tmp_path)
    assert (hit1, hit2) == (False, True)
    assert len(calls) == 1
    assert second.ops == first.ops
    assert inputs.cache_key("broadcast") != key
