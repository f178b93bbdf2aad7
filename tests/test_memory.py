"""Memory budget and signal of the agent cache, on fake cgroup trees."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from hermes_core.gateway.memory import (
    MIB,
    CgroupLimit,
    MemoryPaths,
    find_cgroup_limit,
    malloc_trim,
    memory_signal,
    resolve_memory_budget,
)

GIB = 1024 * MIB
OWN = "/system.slice/gateway.service"


def fake_tree(
    tmp_path: Path,
    files: dict[str, str],
    *,
    proc_cgroup: str = f"0::{OWN}\n",
    layout: str = "v2",
    status: str = "",
) -> MemoryPaths:
    """A cgroup tree under ``tmp_path``: ``layout`` v2 (unified at the root), hybrid
    (unified under ``unified/``) or v1 (no unified hierarchy); ``files`` relative to the root."""
    root = tmp_path / "cgroup"
    root.mkdir(parents=True)
    if layout == "v2":
        (root / "cgroup.controllers").write_text("cpu memory\n")
    elif layout == "hybrid":
        (root / "unified").mkdir()
        (root / "unified" / "cgroup.controllers").write_text("")
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "proc_cgroup").write_text(proc_cgroup)
    (tmp_path / "status").write_text(status)
    return MemoryPaths(root, tmp_path / "proc_cgroup", tmp_path / "status")


def auto(paths: MemoryPaths, total_ram: int = 16 * GIB) -> int | None:
    return resolve_memory_budget("auto", paths=paths, total_ram=lambda: total_ram)


OWN_DIR = OWN.lstrip("/")
V1 = "4:memory:/process_api/abc\n0::/\n"

# (layout, /proc/self/cgroup, files, expected budget in MB or None)
AUTO_TABLE: list[tuple[str, str, str, dict[str, str], int | None]] = [
    ("own memory.high first", "v2", f"0::{OWN}\n",
     {f"{OWN_DIR}/memory.high": str(4 * GIB), f"{OWN_DIR}/memory.max": str(8 * GIB)}, 2662),
    ("own memory.max when high is max", "v2", f"0::{OWN}\n",
     {f"{OWN_DIR}/memory.high": "max\n", f"{OWN_DIR}/memory.max": str(2 * GIB)}, 1331),
    ("root after the own cgroup", "v2", f"0::{OWN}\n",
     {f"{OWN_DIR}/memory.high": "max", f"{OWN_DIR}/memory.max": "max",
      "memory.high": "max", "memory.max": str(8 * GIB)}, 5324),
    ("root when the own cgroup is not mounted here", "v2", "0::/elsewhere\n",
     {"memory.high": str(4 * GIB)}, 2662),
    ("namespace root is the own cgroup", "v2", "0::/\n", {"memory.max": str(2 * GIB)}, 1331),
    ("v1 own limit", "v1", V1,
     {"memory/process_api/abc/memory.limit_in_bytes": str(2 * GIB)}, 1331),
    ("v1 root limit", "hybrid", V1, {"memory/memory.limit_in_bytes": str(4 * GIB)}, 2662),
    ("v2 before v1", "hybrid", "4:memory:/x\n0::/\n",
     {"unified/memory.max": str(2 * GIB), "memory/x/memory.limit_in_bytes": str(4 * GIB)}, 1331),
    ("v1 unlimited is no limit", "v1", V1,
     {"memory/process_api/abc/memory.limit_in_bytes": "9223372036854771712"}, 10649),
    ("2^62 is no limit", "v2", "0::/\n", {"memory.max": str(2**62)}, 10649),
    ("just below 2^62 is a limit", "v2", "0::/\n", {"memory.max": str(2**62 - MIB)},
     int((2**62 - MIB) * 0.65) // MIB),
    ("zero is no limit", "v2", "0::/\n", {"memory.max": "0"}, 10649),
    ("garbage is no limit", "v2", "0::/\n", {"memory.high": "lots", "memory.max": "-5"}, 10649),
    ("no cgroup at all: total RAM", "none", "", {}, 10649),
    ("below 512 MB disables", "v2", "0::/\n", {"memory.max": str(787 * MIB)}, None),
    ("512 MB is enough", "v2", "0::/\n", {"memory.max": str(788 * MIB)}, 512),
]  # fmt: skip


@pytest.mark.parametrize(
    ("layout", "proc_cgroup", "files", "expected_mb"),
    [row[1:] for row in AUTO_TABLE],
    ids=[row[0] for row in AUTO_TABLE],
)
def test_auto_budget(
    tmp_path: Path, layout: str, proc_cgroup: str, files: dict[str, str], expected_mb: int | None
) -> None:
    paths = fake_tree(tmp_path, files, proc_cgroup=proc_cgroup, layout=layout)
    assert auto(paths) == (None if expected_mb is None else expected_mb * MIB)


def test_small_total_ram_disables(tmp_path: Path) -> None:
    assert auto(fake_tree(tmp_path, {}), total_ram=GIB // 2) is None


@pytest.mark.parametrize(
    ("setting", "expected"),
    [(2048, 2048 * MIB), (2048.0, 2048 * MIB), ("300", 300 * MIB), (1.5, int(1.5 * MIB)),
     (None, None), (0, None), (False, None), ("off", None), ("OFF", None), ("none", None),
     ("disabled", None), ("", None), ("false", None), ("0", None)],
)  # fmt: skip
def test_explicit_and_disabled_settings(
    tmp_path: Path, setting: object, expected: int | None
) -> None:
    paths = fake_tree(tmp_path, {"memory.max": str(GIB)})
    assert resolve_memory_budget(setting, paths=paths, total_ram=lambda: 16 * GIB) == expected


@pytest.mark.parametrize("setting", ["auto", "AUTO", True, "true"])
def test_auto_words(tmp_path: Path, setting: object) -> None:
    paths = fake_tree(tmp_path, {"memory.max": str(4 * GIB)})
    assert resolve_memory_budget(setting, paths=paths) == 2662 * MIB


@pytest.mark.parametrize("setting", ["lots", -5, [1024], float("nan")])
def test_unreadable_setting_means_auto_never_off(
    tmp_path: Path, setting: object, caplog: pytest.LogCaptureFixture
) -> None:
    paths = fake_tree(tmp_path, {"memory.max": str(4 * GIB)})
    with caplog.at_level(logging.WARNING, logger="hermes_core.gateway.memory"):
        assert resolve_memory_budget(setting, paths=paths) == 2662 * MIB
    assert "could not be read; using auto" in caplog.text


def test_find_cgroup_limit_names_its_source(tmp_path: Path) -> None:
    paths = fake_tree(tmp_path, {f"{OWN_DIR}/memory.max": str(GIB)})
    assert find_cgroup_limit(paths) == CgroupLimit(
        GIB, paths.cgroup_root / OWN_DIR / "memory.max", 2
    )
    assert find_cgroup_limit(MemoryPaths(tmp_path / "absent", tmp_path / "absent")) is None


def test_signal_is_the_cgroup_anon_under_a_v2_limit(tmp_path: Path) -> None:
    stat = "anon 123456789\nfile 999\nanon_thp 0\n"
    paths = fake_tree(
        tmp_path,
        {f"{OWN_DIR}/memory.max": str(GIB), f"{OWN_DIR}/memory.stat": stat},
        status="RssAnon:\t  2048 kB\n",
    )
    assert memory_signal(paths) == 123456789


def test_signal_under_a_v2_limit_without_a_readable_stat_is_none(tmp_path: Path) -> None:
    paths = fake_tree(tmp_path, {"memory.max": str(GIB), "memory.stat": "anon lots\n"})
    assert memory_signal(paths) is None
    bare = fake_tree(tmp_path / "bare", {"memory.max": str(GIB)})
    assert memory_signal(bare) is None


@pytest.mark.parametrize(
    ("layout", "proc_cgroup", "files"),
    [("v1", V1, {"memory/process_api/abc/memory.limit_in_bytes": str(GIB)}),
     ("v2", "0::/\n", {"memory.max": "max", "memory.stat": "anon 5\n"})],
)  # fmt: skip
def test_signal_is_the_process_anonymous_rss_otherwise(
    tmp_path: Path, layout: str, proc_cgroup: str, files: dict[str, str]
) -> None:
    paths = fake_tree(
        tmp_path, files, proc_cgroup=proc_cgroup, layout=layout,
        status="Name:\tpython\nRssAnon:\t  2048 kB\nRssFile:\t 10 kB\n",
    )  # fmt: skip
    assert memory_signal(paths) == 2048 * 1024


def test_signal_falls_back_to_psutil_without_proc_status(tmp_path: Path) -> None:
    paths = fake_tree(tmp_path, {}, layout="none", proc_cgroup="")
    used = memory_signal(paths)
    assert used is not None
    assert used > MIB


def test_malloc_trim_is_available_where_the_c_library_has_it() -> None:
    assert malloc_trim() is sys.platform.startswith("linux")
