"""Hand the C heap's free memory back to the operating system after a long text was tokenized.

The tokenizers library allocates a hundred bytes and more per character while it encodes a text (alignments of the
normalized string, pre-tokenized splits, tokens), from the arena of whichever thread runs it. glibc frees those
blocks into the arenas but returns their pages to the system only from the top of each heap, so a server that
tokenizes long texts on a pool of threads keeps growing. `malloc_trim(0)` returns the free pages of every arena.
Where the C library has no malloc_trim (musl, macOS, Windows) this does nothing.
"""

from __future__ import annotations

import ctypes


def _malloc_trim() -> ctypes._CFuncPtr | None:
    try:
        libc = ctypes.CDLL(None)  # the symbols the process already has loaded, the C library's among them
    except (OSError, TypeError):  # no dlopen(NULL) on Windows
        return None
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _malloc_trim()


def release_free_heap() -> None:
    """Return the C heap's free pages to the operating system (glibc); ctypes drops the GIL during the call."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
