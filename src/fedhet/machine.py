"""What this machine has, read where the operating system says it (for checks made before memory is allocated)."""

from __future__ import annotations

import os
from pathlib import Path


def host_memory() -> tuple[int, str] | None:
    """(bytes this process may still allocate on the host, where that figure comes from); None where it cannot be
    told. The smaller of /proc/meminfo's MemAvailable and the cgroup's room, else sysconf's free pages."""
    found = []
    available = meminfo_available()
    if available is not None:
        found.append((available, "available (MemAvailable in /proc/meminfo)"))
    cgroup = cgroup_room()
    if cgroup is not None:
        found.append((cgroup, "left under this process's memory limit (cgroup memory.max)"))
    if not found:
        try:
            found.append((os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free (sysconf)"))
        except (AttributeError, OSError, ValueError):
            return None
    return min(found)


def meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_room() -> int | None:
    """Bytes this process's cgroup (v2) may still take, None without a limit."""
    root = Path("/sys/fs/cgroup")
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text().strip()))
    except (OSError, ValueError):
        return None
