"""`colibri plan`: slots per tier from the budgets, traffic per token, the bottleneck, and errors for budgets
that cannot hold one slot per layer."""

from __future__ import annotations

import pytest

from colibri_stream.checkpoint import expert_block_layout, read_config
from colibri_stream.cli import main
from colibri_stream.plan import Bandwidths, make_plan, plan_for_folder
from colibri_stream.errors import ConfigError

MiB = 1 << 20


@pytest.fixture(scope="module")
def config(tiny_model_dir):
    return read_config(tiny_model_dir)


def test_budgets_become_slots_per_layer(config):
    block = expert_block_layout(config)[1]
    layers = len(config.moe_layers)
    plan = make_plan(config, 10 * MiB, "cpu", l2_cache_size=(3 * layers + 1) * block + block - 1)
    assert (plan.host_slots, plan.gpu_slots, plan.fully_resident) == (3, 0, False)
    assert make_plan(config, 0, "cpu").fully_resident  # no budget: the memory map
    assert make_plan(config, 0, "cpu", l2_cache_size=1 << 40).host_slots == config.num_experts
    cuda = make_plan(config, 10 * MiB, "cuda", gpu_memory_limit=10 * MiB + (2 * layers + 1) * block)
    assert (cuda.gpu_slots, cuda.host_slots, cuda.fully_resident) == (2, None, False)
    assert make_plan(config, 10 * MiB, "cuda").fully_resident


def test_budgets_below_one_slot_per_layer_are_refused(config):
    block = expert_block_layout(config)[1]
    with pytest.raises(ConfigError, match=r"--l2-cache-size .* too small: one expert slot per MoE layer"):
        make_plan(config, 0, "cpu", l2_cache_size=len(config.moe_layers) * block)
    with pytest.raises(ConfigError, match="does not even hold the dense weights"):
        make_plan(config, 10 * MiB, "cuda", gpu_memory_limit=10 * MiB)


def test_traffic_and_bottleneck(config):
    block = expert_block_layout(config)[1]
    layers = len(config.moe_layers)
    active = layers * config.top_k * block
    plan = make_plan(config, 64 << 10, "cpu", l2_cache_size=(2 * layers + 1) * block)
    ram, disk = plan.traffic(Bandwidths(), gpu_hit=0.0, host_hit=0.75)
    assert ram.bytes_per_token == (64 << 10) + active and disk.bytes_per_token == active * 0.25
    assert plan.report(Bandwidths(), host_hit=0.75).splitlines()[-2].startswith("Bottleneck: disk")
    fast_disk = Bandwidths(disk=1e15)
    assert "Bottleneck: host RAM" in plan.report(fast_disk, host_hit=0.75)
    cuda = make_plan(config, 4 * MiB, "cuda", gpu_memory_limit=4 * MiB + (2 * layers + 1) * block,
                     l2_cache_size=(4 * layers + 1) * block)
    _, pcie, disk = cuda.traffic(Bandwidths(), gpu_hit=0.5, host_hit=0.5)
    assert pcie.bandwidth == Bandwidths().pcie_pinned and pcie.bytes_per_token == active * 0.5
    assert disk.bytes_per_token == active * 0.25
    bw = Bandwidths(hbm=1e15, host_ram=30e9, pcie_pinned=10e9)
    hybrid = active * 0.5 / 40e9  # misses over host RAM and PCIe together
    assert f"{hybrid * 1e3:.3f} ms/token at best" in cuda.report(bw, gpu_hit=0.5, host_hit=1.0)
    assert "--cpu-experts" not in make_plan(config, 4 * MiB, "cuda").report()
    mapped = make_plan(config, 4 * MiB, "cuda", gpu_memory_limit=4 * MiB + (2 * layers + 1) * block)
    assert mapped.traffic(Bandwidths(), 0.5, 1.0)[1].bandwidth == Bandwidths().pcie_pageable


def test_plan_command(tiny_model_dir, capsys):
    plan = plan_for_folder(tiny_model_dir, "cpu", l2_cache_size=300 << 10)
    assert main(["plan", "--model", str(tiny_model_dir), "--l2-cache-size", "300KiB", "--host-hit-rate", "0.5",
                 "--bw-disk", "3"]) == 0
    out = capsys.readouterr().out
    assert plan.host_slots == 2
    assert f"L2 host  {plan.host_slots:>4} slots/layer" in out
    assert "hit rates host 50.0%:" in out and "at 3.0 GB/s" in out and "disk 3.0 GB/s" in out
    assert main(["plan", "--model", str(tiny_model_dir), "--l2-cache-size", "1KiB"]) == 1
    assert "too small" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--l2-cache-size", "lots"])
