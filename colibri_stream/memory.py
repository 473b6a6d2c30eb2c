"""How much memory there is: the `MemoryInfo` a backend reports for the memory its arrays live in, and the host's."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryInfo:
    """Free and total bytes of the memory a backend's arrays live in."""

    free: int
    total: int
    host: bool  # host RAM (the CPU backend) rather than a GPU's own memory


def host_memory() -> MemoryInfo:
    """The host's RAM: MemAvailable and MemTotal of /proc/meminfo (Linux), else the free and total pages."""
    try:
        with open("/proc/meminfo") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.strip()}
        return MemoryInfo(fields["MemAvailable"], fields["MemTotal"], host=True)
    except (OSError, KeyError, ValueError, IndexError):
        page = os.sysconf("SC_PAGE_SIZE")
        return MemoryInfo(os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page, host=True)
