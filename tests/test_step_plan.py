"""The GPU tier's step plan: the planner's placement of missed experts (whole on the CPU, on the GPU, or one cut by
intermediate rows) and the CPU work a plan hands over, on round numbers."""

from __future__ import annotations

import numpy as np

from colibri_stream.experts.placement import Bandwidths, ExpertNeed
from colibri_stream.experts.step_plan import Cut, LayerPlan, place_misses

# 100 bytes read in 1 s on the CPU, copied in 0.5 s (as tests/test_placement.py).
BW = Bandwidths(host_read=100.0, h2d=200.0, disk=50.0, cpu_flops=1000.0)


def need(**kw) -> ExpertNeed:
    return ExpertNeed(nbytes=100, params=50, tokens=1, **kw)


def test_one_miss_is_cut_in_whole_row_multiples():
    # The CPU takes a third of the expert: the GPU computes 64 of its 96 intermediate rows.
    assert place_misses([7], [need()], BW, 96, every_miss=False) == ([], Cut(7, 64))


def test_a_cut_keeps_whole_groups_of_the_formats_rows():
    # A third on the CPU again: 2/3 of 384 rows is 256, two of int4's (or fp8's) groups of 128 rows, and 2/3 of
    # 288 rows three groups of 64; 2/3 of 192 rows is 128, not a multiple of 96: the nearest one, 96.
    assert place_misses([7], [need()], BW, 384, every_miss=False, row_group=128) == ([], Cut(7, 256))
    assert place_misses([7], [need()], BW, 288, every_miss=False, row_group=64) == ([], Cut(7, 192))
    assert place_misses([7], [need()], BW, 192, every_miss=False, row_group=96) == ([], Cut(7, 96))


def test_every_miss_whole_on_the_cpu_when_asked():
    assert place_misses([3, 5], [need(), need()], BW, 96, every_miss=True) == ([3, 5], None)


def test_four_misses_three_copied_one_on_the_cpu_one_cut():
    on_cpu, cut = place_misses([1, 2, 3, 4], [need()] * 4, BW, 96, every_miss=False)
    assert len(on_cpu) == 1 and cut is not None and cut.gpu_rows == 64
    assert cut.expert not in on_cpu


def test_an_expert_that_cannot_be_cut_stays_whole():
    on_cpu, cut = place_misses([9], [need(splittable=False)], BW, 96, every_miss=False)
    assert cut is None and on_cpu in ([], [9])


def test_cpu_work_lists_whole_experts_then_the_cut_experts_rows_past_the_gpus():
    plan = LayerPlan(rank=0, layer=2, on_cpu=[4, 1], cut=Cut(6, 32), ids=np.zeros((1, 2), np.int64))
    assert plan.cpu_work(96) == [(4, None), (1, None), (6, (32, 96))]
    assert LayerPlan(rank=0, layer=2).cpu_work(96) == []
