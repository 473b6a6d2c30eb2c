"""Which sequences of a step take latent attention's decompressed prefill (cupy_latent_prefill.py), planned on the
host: no GPU needed."""

from __future__ import annotations

import numpy as np

from colibri_stream.backends.cupy_flash_attention import FLASH_ROWS
from colibri_stream.backends.cupy_latent_prefill import plan_latent_prefill, sequences_batch
from colibri_stream.batch import flat_batch


def step(chunks: list[int], starts: list[int]):
    """A step whose sequence b computes chunks[b] tokens from position starts[b] on (blocks of 16)."""
    tables = []
    first = 0
    for tokens, start in zip(chunks, starts):
        blocks = -(-(tokens + start) // 16)
        tables.append(list(range(first, first + blocks)))
        first += blocks
    ids = [list(range(100 * b, 100 * b + n)) for b, n in enumerate(chunks)]
    return flat_batch(ids, starts, tables, [True] * len(chunks), 16)


def test_long_chunks_are_decompressed_in_batch_order_within_the_budget():
    batch = step([1, 80, 5, 200, 64], [40, 0, 7, 300, 1000])  # contexts 41, 80, 12, 500, 1064
    plan = plan_latent_prefill(batch, 64, max_rows=600)
    assert plan.decompressed.tolist() == [1, 3]  # 1064 more rows would pass 600
    assert plan.key_start.tolist() == [0, 80, 580]
    assert plan.absorbed.tolist() == [0, 2, 4]
    # every query row of the decompressed sequences in one tile, the furthest positions first
    rows = sorted((s, r) for s, r0 in plan.tiles for r in range(r0, min(r0 + FLASH_ROWS, (80, 200)[s])))
    assert rows == [(0, r) for r in range(80)] + [(1, r) for r in range(200)]
    assert plan.tiles[0].tolist() == [1, 3 * FLASH_ROWS]
    assert plan_latent_prefill(batch, 201, max_rows=10**6) is None


def test_the_absorbed_sequences_form_a_batch_of_their_own():
    batch = step([1, 80, 5, 200], [40, 0, 7, 300])
    part, rows = sequences_batch(batch, np.array([0, 2]))
    assert rows.tolist() == [0, 81, 82, 83, 84, 85]
    assert part.query_start.tolist() == [0, 1, 6]
    assert part.positions.tolist() == [40, 7, 8, 9, 10, 11]
    assert part.context_lens.tolist() == [41, 12]
    assert np.array_equal(part.block_tables, batch.block_tables[[0, 2]])
    assert np.array_equal(part.slot_mapping, batch.slot_mapping[rows])
    part.validate(16, 10**4)
