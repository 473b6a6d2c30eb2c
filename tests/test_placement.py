"""The CPU-or-GPU cost model for experts outside the GPU: exact costs and step splits on round numbers."""

from __future__ import annotations

import pytest

from colibri_stream.experts.placement import ASSUMED, Bandwidths, ExpertNeed, expert_cost, place_step

# 1 GB/s-scale round numbers: 100 bytes read in 1 s on the CPU, copied in 0.5 s, read from disk in 2 s.
BW = Bandwidths(host_read=100.0, h2d=200.0, disk=50.0, cpu_flops=1000.0)


def need(tokens=1, **kw) -> ExpertNeed:
    return ExpertNeed(nbytes=100, params=50, tokens=tokens, **kw)


def test_bandwidth_bound_cpu_cost_and_copy_cost():
    cost = expert_cost(need(), BW)
    assert (cost.cpu, cost.gpu) == pytest.approx((1.0, 0.5))  # 2*50*1 FLOP = 0.1 s < 1 s read


def test_many_tokens_make_the_cpu_compute_bound():
    assert expert_cost(need(tokens=30), BW).cpu == pytest.approx(3.0)  # 2*50*30 / 1000


def test_disk_read_charged_to_both_sides():
    cost = expert_cost(need(on_disk=True), BW)
    assert (cost.cpu, cost.gpu) == pytest.approx((3.0, 2.5))


def test_in_flight_load_costs_what_is_left():
    assert expert_cost(need(in_flight_seconds=0.1), BW).gpu == pytest.approx(0.1)


def test_expected_reuse_shares_the_load():
    assert expert_cost(need(expected_reuse=4.0), BW).gpu == pytest.approx(0.1)


def test_single_expert_goes_to_the_cheaper_side():
    cpu_fast = Bandwidths(host_read=400.0, h2d=200.0, disk=50.0, cpu_flops=1000.0)
    assert place_step([need()], cpu_fast) == [True]
    assert place_step([need()], BW) == [False]


def test_queues_are_balanced():
    # Each expert: CPU 1 s, copy 0.5 s. Loading all four takes 2 s; three copies and one CPU pass take 1.5 s.
    assert sorted(place_step([need()] * 4, BW)) == [False, False, False, True]


def test_large_expert_placed_first():
    big = ExpertNeed(nbytes=400, params=200, tokens=1)  # CPU 4 s, copy 2 s
    # big -> GPU (2 s); each small one then goes to the CPU while its 1 s ends before the copy queue would.
    assert place_step([need(), big, need()], BW) == [True, False, True]


def test_equal_finish_ties_to_the_cheaper_side_then_gpu():
    even = Bandwidths(host_read=100.0, h2d=100.0, disk=50.0, cpu_flops=1000.0)
    assert place_step([need()], even) == [False]


def test_nothing_needed():
    assert place_step([], ASSUMED) == []


def test_assumed_figures_favour_cpu_for_one_token_on_a_host_resident_expert():
    # A Mixtral expert (352 MB bf16) at one token: 88 GB/s read beats the 55 GB/s copy.
    mixtral = ExpertNeed(nbytes=3 * 4096 * 14336 * 2, params=3 * 4096 * 14336, tokens=1)
    assert place_step([mixtral], ASSUMED) == [True]
    assert place_step([ExpertNeed(mixtral.nbytes, mixtral.params, tokens=64)], ASSUMED) == [False]
