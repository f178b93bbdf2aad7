"""The agent cache's memory budget and memory signal, and ``malloc_trim``.

The budget is what the pressure sweep compares the signal with. ``auto`` derives it from the
cgroup limit the process runs under (v2 ``memory.high``, then ``memory.max``, in the own cgroup and
then at the cgroup root, then v1 ``memory.limit_in_bytes``) or, without a limit, from total RAM.
The signal is the anonymous memory the limit is charged for: the cgroup's ``anon`` under a v2
limit (it counts the gateway's child processes too), else the process's anonymous RSS.

Every path is injectable through :class:`MemoryPaths` so tests can use a fake tree. Everything
here does blocking file I/O: call it off the event loop.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import psutil
from pydantic import ValidationError

from hermes_core.config.schema import AgentCacheConfig

__all__ = [
    "AUTO_FRACTION", "DEFAULT_PATHS", "MIB", "MIN_AUTO_BUDGET_MB", "CgroupLimit", "MemoryPaths",
    "find_cgroup_limit", "malloc_trim", "memory_signal", "resolve_memory_budget",
]  # fmt: skip

logger = logging.getLogger(__name__)

MIB = 1024 * 1024
"""One MB as ``memory_high_mb`` counts it (the binary unit cgroups and ``free -m`` use)."""
AUTO_FRACTION = 0.65
"""Share of the limit (or of total RAM) that ``auto`` makes the budget."""
MIN_AUTO_BUDGET_MB = 512
"""An ``auto`` budget below this many MB disables pressure eviction (too small to be useful)."""
_LIMIT_CEILING = 2**62  # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1


@dataclass(frozen=True)
class MemoryPaths:
    """Where the cgroup tree and the process's own files are; tests point these at ``tmp_path``."""

    cgroup_root: Path = Path("/sys/fs/cgroup")
    proc_cgroup: Path = Path("/proc/self/cgroup")
    proc_status: Path = Path("/proc/self/status")


DEFAULT_PATHS = MemoryPaths()
"""The real system paths."""


@dataclass(frozen=True)
class CgroupLimit:
    """A memory limit found in the cgroup tree: its bytes, the file it came from, the version."""

    limit: int
    path: Path
    version: Literal[1, 2]


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError):
        return None


def _limit_at(path: Path) -> int | None:
    """The limit in ``path`` if it is a real one (0 < limit < 2^62); ``max`` means none."""
    text = _read(path)
    if text is None:
        return None
    try:
        value = int(text.strip())
    except ValueError:  # "max", or garbage
        return None
    return value if 0 < value < _LIMIT_CEILING else None


def _own_cgroups(paths: MemoryPaths) -> tuple[str | None, str | None]:
    """The process's v2 cgroup and v1 memory cgroup, from ``/proc/self/cgroup``."""
    v2: str | None = None
    v1: str | None = None
    for line in (_read(paths.proc_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, cgroup = parts
        if hierarchy == "0" and not controllers:
            v2 = cgroup
        elif "memory" in controllers.split(","):
            v1 = cgroup
    return v2, v1


def _under(mount: Path, cgroup: str | None) -> list[Path]:
    """The own cgroup's directory under ``mount`` (when known), then the mount's root."""
    dirs = [mount / cgroup.lstrip("/")] if cgroup is not None else []
    return [*dirs, mount] if mount not in dirs else dirs


def find_cgroup_limit(paths: MemoryPaths = DEFAULT_PATHS) -> CgroupLimit | None:
    """The memory limit the process runs under, or None without one: cgroup v2
    ``memory.high``, then ``memory.max`` (own cgroup, then the root), then v1's limit."""
    v2, v1 = _own_cgroups(paths)
    root = paths.cgroup_root
    unified = root if (root / "cgroup.controllers").exists() else root / "unified"
    for directory in _under(unified, v2):
        for name in ("memory.high", "memory.max"):
            limit = _limit_at(directory / name)
            if limit is not None:
                return CgroupLimit(limit, directory / name, 2)
    for directory in _under(root / "memory", v1):
        limit = _limit_at(directory / "memory.limit_in_bytes")
        if limit is not None:
            return CgroupLimit(limit, directory / "memory.limit_in_bytes", 1)
    return None


def _parse_setting(setting: object) -> Literal["auto"] | float | None:
    """``memory_high_mb`` as parsed by the configuration; a value it cannot read means ``auto``."""
    try:
        return AgentCacheConfig.model_validate({"memory_high_mb": setting}).memory_budget_setting
    except ValidationError:
        logger.warning("memory_high_mb %r could not be read; using auto", setting)
        return "auto"


def resolve_memory_budget(
    setting: object = "auto",
    *,
    paths: MemoryPaths = DEFAULT_PATHS,
    total_ram: Callable[[], int] | None = None,
) -> int | None:
    """The pressure budget in bytes for ``memory_high_mb``, or None when disabled.

    ``setting`` is the parsed ``AgentCacheConfig.memory_budget_setting`` or a raw value: ``auto``
    is 65 % of the cgroup limit (else of total RAM, ``total_ram`` defaulting to psutil's),
    floored to whole MB and disabled below 512 MB; a positive number is that many MB; ``None``
    and the "off" words disable. A value that cannot be read counts as ``auto``, never as off.
    """
    parsed = _parse_setting(setting)
    if parsed is None:
        return None
    if parsed != "auto":
        return int(parsed * MIB)
    found = find_cgroup_limit(paths)
    limit = found.limit if found else (total_ram or _total_ram)()
    budget_mb = math.floor(limit * AUTO_FRACTION / MIB)
    source = f"cgroup v{found.version} {found.path}" if found else "total RAM"
    if budget_mb < MIN_AUTO_BUDGET_MB:
        logger.info("memory budget off: 65 %% of %s is %d MB (< 512)", source, budget_mb)
        return None
    logger.info("memory budget %d MB: 65 %% of %s", budget_mb, source)
    return budget_mb * MIB


def _total_ram() -> int:
    return int(psutil.virtual_memory().total)


def _stat_field(path: Path, field: str) -> int | None:
    """One counter of a cgroup ``memory.stat`` file, or None when unreadable."""
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == field:
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _process_anon_rss(paths: MemoryPaths) -> int | None:
    """Anonymous RSS of this process: ``RssAnon`` on Linux, else psutil's USS, else its RSS."""
    for line in (_read(paths.proc_status) or "").splitlines():
        if line.startswith("RssAnon:"):
            try:
                return int(line.split()[1]) * 1024
            except (IndexError, ValueError):
                break
    try:
        process = psutil.Process()
        try:
            return int(process.memory_full_info().uss)
        except (psutil.AccessDenied, AttributeError):
            return int(process.memory_info().rss)
    except psutil.Error:
        return None


def memory_signal(paths: MemoryPaths = DEFAULT_PATHS) -> int | None:
    """Bytes of anonymous memory the budget is compared with, or None when unreadable.

    Under a cgroup v2 limit: ``anon`` in that cgroup's ``memory.stat`` (it includes child
    processes of the same unit); otherwise the process's anonymous RSS. None skips the pass.
    """
    found = find_cgroup_limit(paths)
    if found is not None and found.version == 2:
        return _stat_field(found.path.parent / "memory.stat", "anon")
    return _process_anon_rss(paths)


@functools.cache
def _libc_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
    except (OSError, TypeError):  # no C library to load on this platform
        return None
    trim: Callable[[int], int] | None = getattr(libc, "malloc_trim", None)
    return trim


def malloc_trim() -> bool:
    """Return freed heap memory to the OS (glibc ``malloc_trim(0)``); False where unavailable."""
    trim = _libc_malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
