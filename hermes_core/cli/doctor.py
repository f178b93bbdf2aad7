"""``hermes-sessions doctor [--fix] [--json]``: check a gateway's state and repair what is safe.

Checks (read-only): file types and modes, the instance lock, the plugins (a conflict, or an
essential plugin disabled, is a finding naming the plugins and the fix; the checks it stops say
so), the store (reachable, schema, integrity, foreign keys), the full-text index (its own check
and a real query), routing rows against sessions, the ``sessions.json`` mirror against the
routing table, the degraded-mode backlog, the delivery ledger, the counter and clean-shutdown
files, the PII key and the directories platforms declare (``PlatformSpec.state_dirs``, such as
WhatsApp's mapping directory). ``--fix`` (the gateway stopped) tightens modes, rebuilds the
index, rewrites the mirror, replays the backlog and replaces an invalid PII key; it never touches
messages, and for a corrupt database it prints the recovery procedure and changes nothing.
Exit status: 0 healthy (or fixed), 1 problems remain, 2 could not run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import stat
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hermes_core.cli.common import open_operator, open_store, print_json, progress
from hermes_core.cli.doctor_routes import (
    NOT_CHECKED,
    PLUGIN_PROBLEM,
    ROUTE_PAGE,
    Finding,
    MirrorComparison,
    walk_routes,
)
from hermes_core.cli.outputs import backend_files, gateway_files
from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import (
    ConfigError,
    CorruptDatabaseError,
    GatewayLockedError,
    PluginError,
    StoreError,
    shown,
)
from hermes_core.gateway.redaction import load_hmac_key
from hermes_core.plugins.manager import HermesPluginManager, create_plugin_manager
from hermes_core.state.instance import (
    CLEAN_SHUTDOWN_FILE,
    RESTART_COUNTS_FILE,
    lock_holder,
)
from hermes_core.store.leases import CLOCK_SLACK_SECS, lease_state
from hermes_core.store.operator import OperatorBackend

PROCEDURE = (
    "the database is corrupt; doctor changes nothing. To recover: stop the gateway; copy "
    "state.db, state.db-wal and state.db-shm aside; restore the newest backup that passes "
    "`sqlite3 state.db 'PRAGMA integrity_check'` (without stale -wal/-shm files); failing that, "
    "move state.db aside as state.db.corrupt-<YYYYMMDDTHHMMSSZ> and start the gateway: it creates "
    "a fresh database and re-imports the routing index from sessions.json (transcripts not in a "
    "backup are lost)."
)
_PII_KEY = re.compile(rb"[0-9a-f]{64}\n?")


def register(commands: Any, parents: list[argparse.ArgumentParser]) -> None:
    """Add ``doctor``."""
    doctor = commands.add_parser(
        "doctor", parents=parents, help="check the state and repair what is safe",
        allow_abbrev=False,
    )  # fmt: skip
    doctor.add_argument("--fix", action="store_true", help="repair what is safe (gateway stopped)")
    doctor.add_argument("--json", action="store_true", help="print one JSON object")
    doctor.set_defaults(handler=doctor_command)


def _plugin_findings(plugins: HermesPluginManager) -> list[Finding]:
    """A plugin conflict or a lost essential plugin, each a problem whose detail names the
    plugins and the fix (nothing when there is none)."""
    return [Finding("plugins", "problem", message) for message in plugins.problems()]


def _file_findings(config: GatewayConfig, plugins: HermesPluginManager) -> list[Finding]:
    home, sessions = config.hermes_home, config.sessions_dir
    found = []
    for directory in (home, sessions):
        if directory == sessions and directory.is_symlink():  # $HERMES_HOME may be one
            found.append(Finding("files", "problem", f"{directory} is a symlink, which the "
                                 "store refuses", "put the directory it points at in its place "
                                 "(or set gateway.sessions_dir to it); doctor never follows "
                                 "it"))  # fmt: skip
        elif not directory.is_dir():
            found.append(Finding("files", "problem", f"{directory} is not a directory"))
        elif stat.S_IMODE(directory.stat().st_mode) & 0o077:
            mode = stat.S_IMODE(directory.stat().st_mode)
            found.append(Finding("files", "problem", f"{directory} has mode {mode:04o}, not 0700",
                                 "--fix tightens it"))  # fmt: skip
    paths = gateway_files(config)
    with contextlib.suppress(*PLUGIN_PROBLEM):  # no store chosen: no store files to check
        paths += backend_files(config, plugins)
    if sessions.is_dir() and not sessions.is_symlink():
        paths += sorted(sessions.glob("*.json")) + sorted(sessions.glob("*.jsonl*"))
    for path in paths:
        try:
            info = path.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(info.st_mode) or not stat.S_ISREG(info.st_mode):
            found.append(Finding("files", "problem", f"{path} is not a regular file",
                                 "move it aside; doctor never follows it"))  # fmt: skip
        elif stat.S_IMODE(info.st_mode) & 0o077:
            mode = stat.S_IMODE(info.st_mode)
            found.append(Finding("files", "problem", f"{path} has mode {mode:04o}, not 0600",
                                 "--fix tightens it"))  # fmt: skip
    return found or [Finding("files", "ok", "directories 0700, files regular and 0600")]


def _tighten_modes(config: GatewayConfig, plugins: HermesPluginManager) -> None:
    """chmod what :func:`_file_findings` found too open, through a descriptor opened without
    following a symlink (but for ``$HERMES_HOME``, which may be one): a link planted since the
    check is never followed out of the state directory."""
    for finding in _file_findings(config, plugins):
        if finding.fix == "--fix tightens it":
            path = Path(finding.detail.split(" has mode ", 1)[0])
            follow = 0 if path == config.hermes_home else os.O_NOFOLLOW
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | follow)
            try:
                os.fchmod(fd, 0o700 if stat.S_ISDIR(os.fstat(fd).st_mode) else 0o600)
            finally:
                os.close(fd)


def _database_findings(
    backend: OperatorBackend, mirror: MirrorComparison, *, quiet: bool, page: int
) -> tuple[list[Finding], int]:
    """The store's findings, and how many lanes it holds (the routing table is walked once,
    with a progress bar unless ``quiet``, for its own checks and ``mirror``'s)."""
    integrity = backend.integrity_problems()
    with progress("doctor: routing", backend.count_records(backend.record_kinds().routes),
                  quiet=quiet) as bar:  # fmt: skip
        walk = walk_routes(backend, mirror, bar, page)
    if integrity:
        return [Finding("integrity", "problem", "; ".join(integrity[:5]), PROCEDURE)], walk.lanes
    found = [Finding("integrity", "ok", "integrity and foreign-key checks pass")]
    fts = backend.health()["fts"]
    problems = backend.fts_problems()
    if fts == "stale":
        problems.insert(0, "marked stale after a failed write (search uses a slow scan)")
    if fts == "unavailable":
        found.append(Finding("fts", "warn", "full-text search is unavailable in this SQLite"))
    elif problems:
        found.append(Finding("fts", "problem", "; ".join(problems), "--fix rebuilds the index"))
    else:
        found.append(Finding("fts", "ok", "index consistent and queryable"))
    found += walk.findings()
    counts = backend.obligation_counts()
    now = time.time()
    stuck = [
        row for row in backend.obligations(["attempting"])
        if row.lease_expires_at is not None and row.lease_expires_at < now
    ]  # fmt: skip
    detail = ", ".join(f"{state} {count}" for state, count in sorted(counts.items())) or "empty"
    if stuck:
        found.append(Finding("ledger", "warn", f"{len(stuck)} row(s) stuck attempting past "
                             f"their lease ({detail})", "the next start-up's sweep settles "
                             "them"))  # fmt: skip
    else:
        found.append(Finding("ledger", "ok", detail))
    return found, walk.lanes


def _lease_finding(backend: OperatorBackend, config: GatewayConfig) -> Finding:
    """Turn leases and the durable queues of a shared store: a lease row with an expiry no
    gateway writes (junk) is named; what waits in the queues is counted either way."""
    leases = backend.lease_rows()
    now, ttl = time.time(), config.storage.turn_lease_secs
    states = [lease_state(expires, now, ttl, CLOCK_SLACK_SECS) for _, _, expires in leases]
    invalid = [key for (key, _, _), state in zip(leases, states, strict=True) if state == "invalid"]
    queued = backend.queued()
    waiting = f"{len(queued)} event(s) queued on {len({key for _, key, _ in queued})} lane(s)"
    if invalid:
        return Finding(
            "leases", "problem",
            f"{len(invalid)} lease(s) with an expiry no gateway writes (NaN, infinite or more than "
            f"storage.turn_lease_secs ahead), e.g. {shown(invalid[0])}; {waiting}",
            "a running gateway treats such a lease as lapsed and takes the lane over at its next "
            "scan (storage.lease_scan_secs); with every gateway stopped, `hermes-sessions show "
            "KEY` names the lane's lease, and deleting its row frees the lane",
        )  # fmt: skip
    live = states.count("live")
    return Finding("leases", "ok", f"{len(leases)} lease(s), {live} live; {waiting}")


def _backlog(config: GatewayConfig) -> list[Path]:
    sessions = config.sessions_dir  # a symlinked one is a finding of its own, never followed
    return (
        sorted(sessions.glob("*.jsonl")) if sessions.is_dir() and not sessions.is_symlink() else []
    )


def _other_files(config: GatewayConfig, plugins: HermesPluginManager) -> list[Finding]:
    home, found = config.hermes_home, []
    for name in (RESTART_COUNTS_FILE, CLEAN_SHUTDOWN_FILE):
        path = home / name
        if not path.is_file() or path.is_symlink():
            continue
        try:
            if not isinstance(json.loads(path.read_bytes().decode("utf-8-sig")), dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            found.append(Finding("state files", "warn", f"{path} cannot be used ({exc}); it is "
                                 "treated as empty or an unclean stop"))  # fmt: skip
    key = config.pii_hmac_key_file
    if key.is_file() and not key.is_symlink() and not _PII_KEY.fullmatch(key.read_bytes()):
        found.append(Finding("pii key", "problem", f"{key} does not hold 64 lowercase hex digits",
                             "--fix replaces it (pseudonyms change)"))  # fmt: skip
    with contextlib.suppress(*PLUGIN_PROBLEM):  # no platforms known: none of their files
        for spec in plugins.platforms().values():
            for directory in spec.state_dirs(home) if spec.state_dirs is not None else ():
                if directory.exists() and not os.access(directory, os.R_OK | os.X_OK):
                    found.append(Finding(spec.name, "problem", f"{directory} is not readable",
                                         "make it readable by the gateway's user"))  # fmt: skip
    return found or [Finding("state files", "ok", "counter, clean-shutdown and PII key files")]


def run_checks(
    config: GatewayConfig,
    plugins: HermesPluginManager,
    *,
    quiet: bool = False,
    page: int = ROUTE_PAGE,
) -> tuple[list[Finding], int | None]:
    """Every check, read-only; also the pid of a running gateway (None when stopped). The
    routing table is read ``page`` rows at a time, with a progress bar on a terminal unless
    ``quiet``."""
    running = lock_holder(config.hermes_home)
    findings = _file_findings(config, plugins)
    findings.append(
        Finding("lock", "ok", "no gateway is running")
        if running is None
        else Finding("lock", "warn", f"a gateway (pid {running}) is running")
    )
    findings += _plugin_findings(plugins)
    mirror = MirrorComparison(config, plugins, running=running is not None)
    try:
        backend = open_operator(config, write=False, plugins=plugins)
    except CorruptDatabaseError:
        return [
            *findings,
            Finding("store", "problem", "the database is corrupt", PROCEDURE),
        ], running
    except PLUGIN_PROBLEM:
        return [*findings, Finding("store", "warn", NOT_CHECKED)], running
    except (StoreError, PluginError) as exc:  # PluginError: a backend lacking what it declares
        return [*findings, Finding("store", "problem", str(exc))], running
    try:
        findings.append(Finding("store", "ok", f"{backend.name} reachable, schema current"))
        try:
            found, lanes = _database_findings(backend, mirror, quiet=quiet, page=page)
            findings += found
            findings.append(_lease_finding(backend, config))
        except CorruptDatabaseError:
            findings.append(Finding("integrity", "problem", "the database is corrupt", PROCEDURE))
            return findings, running
    finally:
        backend.close()
    findings.append(mirror.finding(lanes))
    backlog = _backlog(config)
    findings.append(
        Finding(
            "backlog",
            "problem",
            f"{len(backlog)} degraded-mode transcript file(s) not yet replayed into the database",
            "--fix replays them",
        )
        if backlog
        else Finding("backlog", "ok", "no degraded-mode backlog")
    )
    return findings + _other_files(config, plugins), running


def apply_fixes(
    config: GatewayConfig, findings: list[Finding], plugins: HermesPluginManager
) -> list[str]:
    """Repair what ``findings`` mark fixable by ``--fix``; what was done, one line each."""
    wanted = {finding.check for finding in findings if (finding.fix or "").startswith("--fix")}
    done = []
    if "files" in wanted:
        _tighten_modes(config, plugins)
        done.append("tightened file and directory modes")
    if "pii key" in wanted:
        key = config.pii_hmac_key_file
        aside = key.with_name(
            f"{key.name}.invalid-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
        )
        key.rename(aside)
        load_hmac_key(key)
        done.append(f"replaced the PII key (the old one is {aside.name}; pseudonyms change)")
    if wanted & {"fts", "mirror", "backlog"}:
        with open_store(config, write=True, plugins=plugins) as store:
            if "backlog" in wanted:
                report = store._fallback.replay_backlog()
                replayed = report.messages_imported if report is not None else 0
                done.append(f"replayed the degraded-mode backlog ({replayed} message(s))")
            if "fts" in wanted and store.rebuild_search_index():
                done.append("rebuilt the full-text index")
            store._fallback.rewrite_mirror()
            if "mirror" in wanted:
                done.append("rewrote sessions.json from the routing table")
    return done


def doctor_command(args: argparse.Namespace, config: GatewayConfig) -> int:
    """``doctor [--fix] [--json]``: the plugins are loaded without :meth:`check
    <HermesPluginManager.check>`, so that their problems are findings."""
    plugins = create_plugin_manager(config, check=False)
    findings, running = run_checks(config, plugins, quiet=args.json)
    done: list[str] = []
    if args.fix:
        if running is not None:
            raise GatewayLockedError(
                f"a gateway (pid {running}) is running on {config.hermes_home}; stop it before "
                "`hermes-sessions doctor --fix` (plain `doctor` may run beside it)."
            )
        # Another writer holding the store refuses this (GatewayLockedError, exit 2); an
        # unreachable or corrupt store, or the plugins' problem, is in the findings already,
        # and no fix opens it.
        with contextlib.suppress(StoreError, PluginError, ConfigError):
            open_operator(config, write=True, plugins=plugins).close()
        before = {(f.check, f.detail) for f in findings if f.status == "problem"}
        done = apply_fixes(config, findings, plugins)
        if done:
            findings, running = run_checks(config, plugins, quiet=args.json)
            fixed = {f.check for f in findings if f.status == "problem"}
            findings += [Finding(check, "fixed", detail) for check, detail in sorted(before)
                         if check not in fixed]  # fmt: skip
    problems = [f for f in findings if f.status == "problem"]
    if args.json:
        print_json({"healthy": not problems, "findings": [asdict(f) for f in findings],
                    "fixed": done})  # fmt: skip
        return 1 if problems else 0
    for finding in findings:
        print(f"{finding.status:8} {finding.check}: {finding.detail}")
        if finding.fix and finding.status == "problem":
            print(f"         fix: {finding.fix}")
    for line in done:
        print(f"done: {line}")
    if problems:
        fixable = any((f.fix or "").startswith("--fix") for f in problems)
        hint = "; run `hermes-sessions doctor --fix`" if fixable and not args.fix else ""
        print(f"verdict: {len(problems)} problem(s){hint}")
        return 1
    print("verdict: healthy")
    return 0
