"""The flash attention kernel's tile list (cupy_flash_attention.py), built on the host: no GPU needed."""

from __future__ import annotations

import numpy as np

from colibri_stream.backends.cupy_flash_attention import FLASH_ROWS, flash_tiles


def test_tiles_cover_every_row_once_longest_first():
    query_start = np.array([0, 1, 150, 153], np.int64)  # chunks of 1, 149 and 3 tokens
    positions = np.concatenate([[9], np.arange(100, 249), np.arange(4000, 4003)]).astype(np.int64)
    tiles = flash_tiles(query_start, positions, 4)  # rows: 4, 596, 12
    rows = [(b, r) for b, r0 in tiles for r in range(r0, min(r0 + FLASH_ROWS, 4 * np.diff(query_start)[b]))]
    assert sorted(rows) == [(b, r) for b in range(3) for r in range(4 * np.diff(query_start)[b])]
    assert tiles[0].tolist() == [2, 0]  # the chunk at position 4000
    assert tiles[1].tolist() == [1, 9 * FLASH_ROWS]  # the last tile of the 149-token chunk (rows 576-595)
    assert tiles[-1].tolist() == [0, 0]
