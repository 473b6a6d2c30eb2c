"""The CPU-or-GPU cost model for experts outside the GPU: exact costs, step placements and row splits on round
numbers."""

from __future__ import annotations

import pytest

from colibri_stream.experts.placement import (
    ASSUMED,
    Bandwidths,
    ExpertNeed,
    corrected,
    expert_cost,
    gpu_rows,
    place_step,
)

# 1 GB/s-scale round numbers: 100 bytes read in 1 s on the CPU, copied in 0.5 s, read from disk in 2 s.
BW = Bandwidths(host_read=100.0, h2d=200.0, disk=50.0, cpu_flops=1000.0)


def need(tokens=1, **kw) -> ExpertNeed:
    return ExpertNeed(nbytes=100, params=50, tokens=tokens, **kw)


def whole(tokens=1, **kw) -> ExpertNeed:
    """An expert that cannot be split (the whole-expert placement alone)."""
    return need(tokens, splittable=False, **kw)


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
    assert place_step([whole()], cpu_fast) == [1.0]
    assert place_step([whole()], BW) == [0.0]


def test_queues_are_balanced():
    # Each expert: CPU 1 s, copy 0.5 s. Loading all four takes 2 s; three copies and one CPU pass take 1.5 s.
    assert sorted(place_step([whole()] * 4, BW)) == [0.0, 0.0, 0.0, 1.0]


def test_large_expert_placed_first():
    big = ExpertNeed(nbytes=400, params=200, tokens=1, splittable=False)  # CPU 4 s, copy 2 s
    # big -> GPU (2 s); each small one then goes to the CPU while its 1 s ends before the copy queue would.
    assert place_step([whole(), big, whole()], BW) == [1.0, 0.0, 1.0]


def test_equal_finish_ties_to_the_cheaper_side_then_gpu():
    even = Bandwidths(host_read=100.0, h2d=100.0, disk=50.0, cpu_flops=1000.0)
    assert place_step([whole()], even) == [0.0]


def test_nothing_needed():
    assert place_step([], ASSUMED) == []


def test_assumed_figures_favour_cpu_for_one_token_on_a_host_resident_expert():
    # A Mixtral expert (352 MB bf16) at one token: 88 GB/s read beats the 55 GB/s copy.
    mixtral = ExpertNeed(nbytes=3 * 4096 * 14336 * 2, params=3 * 4096 * 14336, tokens=1)
    assert place_step([ExpertNeed(mixtral.nbytes, mixtral.params, tokens=1, splittable=False)], ASSUMED) == [1.0]
    assert place_step([ExpertNeed(mixtral.nbytes, mixtral.params, tokens=64, splittable=False)], ASSUMED) == [0.0]
    # Split at 64 tokens the CPU (compute bound: 22.5 ms whole) takes about a fifth next to the 6.4 ms copy.
    assert place_step([ExpertNeed(mixtral.nbytes, mixtral.params, tokens=64)], ASSUMED)[0] == pytest.approx(0.22, 0.05)


def test_one_miss_is_cut_where_both_sides_end_together():
    # CPU 1 s, copy 0.5 s for the whole expert: the CPU takes a third (1/3 s), the copy two thirds (1/3 s).
    assert place_step([need()], BW) == [pytest.approx(1 / 3)]


def test_split_balances_whole_placements():
    # Whole experts: three copies (1.5 s) and one CPU pass (1 s). Cutting one copied expert, a third to the CPU,
    # ends both queues at 4/3 s, the fractional optimum of the four.
    shares = sorted(place_step([need()] * 4, BW))
    assert shares == [0.0, 0.0, pytest.approx(1 / 3), 1.0]


def test_a_split_that_ends_no_earlier_is_not_made():
    # The load in flight has 10 s left: the CPU computes that expert (1 s) and the other is copied (0.5 s); giving
    # the CPU any of the copied one's rows would end later than 1 s.
    assert place_step([need(in_flight_seconds=10.0), need()], BW) == [1.0, 0.0]


@pytest.mark.parametrize("kw", [{"splittable": False}, {"in_flight_seconds": 0.4}, {"expected_reuse": 1.0}])
def test_loads_in_flight_reused_or_unsplittable_are_never_cut(kw):
    assert place_step([need(**kw)], BW)[0] in (0.0, 1.0)


@pytest.mark.parametrize("share, rows, expected", [
    (1 / 3, 96, 64),  # two thirds of the rows to the GPU
    (0.99, 96, 0),  # the GPU's part under one multiple: all on the CPU
    (0.01, 96, 96),  # the CPU's part under one multiple: all on the GPU
    (0.1, 100, 100),  # 96 on the GPU would leave 4 (under 16) to the CPU
    (0.0, 14336, 14336),
    (1.0, 14336, 0),
])
def test_gpu_rows_are_multiples_and_never_a_sliver(share, rows, expected):
    assert gpu_rows(share, rows, 16) == expected


def test_slow_cpu_work_lowers_the_cpu_rates_a_quarter_of_the_way():
    slower = corrected(BW, "cpu", predicted=1.0, observed=1.6)  # 1.6x slower than the rates say
    assert slower.host_read == pytest.approx(100.0 / 1.6 ** 0.25)
    assert slower.cpu_flops == pytest.approx(1000.0 / 1.6 ** 0.25)
    assert (slower.h2d, slower.disk) == (BW.h2d, BW.disk)


def test_one_observation_moves_a_rate_at_most_by_its_clamp():
    assert corrected(BW, "copy", predicted=1.0, observed=100.0).h2d == pytest.approx(200.0 * 0.5 ** 0.25)
    assert corrected(BW, "copy", predicted=100.0, observed=1.0).h2d == pytest.approx(200.0 * 2.0 ** 0.25)


def test_repeated_observations_converge_on_the_true_rate():
    bw = BW
    for _ in range(60):  # the copy really moves 150 bytes/s: each step's 100 bytes take 2/3 s
        bw = corrected(bw, "copy", predicted=100.0 / bw.h2d, observed=100.0 / 150.0)
    assert bw.h2d == pytest.approx(150.0, rel=1e-3)


def test_nothing_observed_changes_nothing():
    assert corrected(BW, "cpu", 0.0, 1.0) is BW
    with pytest.raises(ValueError, match="side"):
        corrected(BW, "disk", 1.0, 1.0)



def test_no_cut_when_whole_experts_are_already_about_balanced():
    # CPU 1 s, copy 0.95 s each: one expert on each side ends at 1 s; the best cut ends at 0.976 s, less than
    # MIN_CUT_GAIN sooner, so nothing is cut (a cut has costs of its own).
    close = Bandwidths(host_read=100.0, h2d=105.0, disk=50.0, cpu_flops=1000.0)
    assert sorted(place_step([need(), need()], close)) == [0.0, 1.0]
