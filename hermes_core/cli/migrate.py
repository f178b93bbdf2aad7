"""``hermes-sessions migrate --to URL``: copy every kind of stored record (every table, for a SQL
store) to another store (SQLite to PostgreSQL or back), in batches keyed by primary key, each
batch one transaction that skips the records the target holds already; then rebuild the
full-text index there and verify each kind by record count and checksum. The source backend
names the kinds (:class:`~hermes_core.store.operator.RecordKinds`); the target must keep the
same ones.

A run that was interrupted (even killed) is resumed by running it again: its committed batches
stay, and the re-run compares them with the source once (:func:`check_target`, which walks the
source in the copy's order only as far as the target holds records) and goes on from there,
each batch skipping what the target holds, so every record ends there once. Before writing
anything it refuses a target that is one of the source's own files (those its
``StoreSpec.files`` declares) or that holds anything but part of this source's copy: a record
the source lacks or holds otherwise means another store, or this store's copy from before the
source changed."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from hermes_core.cli.common import open_operator, print_json, progress, with_url
from hermes_core.cli.outputs import backend_files, refuse_store_file
from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import InvalidValueError, StoreError
from hermes_core.store.operator import OperatorBackend

BATCH_ROWS = 500


class MigrationMismatchError(StoreError):
    """The copy does not match its source after a migration."""


class ForeignTargetError(StoreError):
    """The migration's target holds rows that are not part of the source's copy."""


def register(commands: Any, parents: list[argparse.ArgumentParser]) -> None:
    """Add ``migrate``."""
    migrate = commands.add_parser(
        "migrate", parents=parents, allow_abbrev=False,
        help="copy all stored state to another store (resumable, verified)",
    )  # fmt: skip
    migrate.add_argument("--to", required=True, metavar="URL", help="the target store's URL")
    migrate.add_argument("--json", action="store_true", help="print one JSON object")
    migrate.set_defaults(handler=migrate_command)


@dataclass(frozen=True, slots=True)
class Copied:
    """How far an earlier run copied a kind: the records the target holds (each one of the
    source's) and the source's key that the copy goes on after (None: from its first)."""

    records: int
    after: tuple[Any, ...] | None


def check_target(source: OperatorBackend, target: OperatorBackend) -> dict[str, Copied]:
    """How far each kind is copied, or :class:`ForeignTargetError` unless every record of
    ``target`` is a record of ``source`` (an empty target, or one an interrupted migration of
    this source filled in part)."""
    kinds = source.record_kinds().transfer
    if target.record_kinds().transfer != kinds:
        raise ForeignTargetError(
            f"the target's {target.name} store keeps other kinds of record than this "
            f"{source.name} store; nothing was copied. Migrate into a store of a backend that "
            "keeps the same ones."
        )
    return {name: _copied(source, target, name) for name in kinds}


def _copied(source: OperatorBackend, target: OperatorBackend, name: str) -> Copied:
    """Walk the kind in the source's key order (the copy's), comparing each batch with what
    the target holds, until every record the target holds is found: the walk reads only the
    part copied before, and it stops where the copy goes on (at the first batch the target
    lacks part of, when the source changed since). The target's own key order is never used:
    a text key sorts by each database's collation."""
    held = target.count_records(name)
    found, after, resume = 0, None, None
    lacking = False
    while found < held and (rows := source.table_rows(name, after, BATCH_ROWS)):
        match = target.held_rows(name, rows)
        if match.other:
            raise _foreign(name, match.other)
        if match.same < len(rows) and not lacking:
            lacking, resume = True, after
        found += match.same
        after = source.primary_key(name, rows[-1])
    if found < held:
        raise _foreign(name, held - found)
    return Copied(held, resume if lacking else after)


def _foreign(name: str, rows: int) -> ForeignTargetError:
    return ForeignTargetError(
        f"the target already holds another store ({rows} row(s) of its table {name} are not "
        "rows of this one); nothing was copied. Migrate into an empty database, or into the "
        "target of an interrupted migration of this same store."
    )


def _check_before_writing(
    source: OperatorBackend, target_config: GatewayConfig
) -> dict[str, Copied] | None:
    """:func:`check_target` on the target opened read-only, so that another store is refused
    before its writer lock is taken or its schema touched; None for a target that cannot be
    read as it is (nothing there yet, an older schema): it is checked once opened for
    writing."""
    try:
        probe = open_operator(target_config, write=False, plugins=None)
    except StoreError:
        return None
    try:
        return check_target(source, probe)
    finally:
        probe.close()


def copy_tables(
    source: OperatorBackend,
    target: OperatorBackend,
    copied: dict[str, Copied],
    *,
    quiet: bool = False,
) -> dict[str, int]:
    """Copy each kind from where ``copied`` (:func:`check_target`) says the earlier runs
    stopped, a batch per transaction that skips the records the target holds (so a batch it
    holds in part is harmless); records inserted per kind. A progress bar counts the records
    the target holds of the source's total (``quiet``: none)."""
    kinds = source.record_kinds()
    counts = {name: source.count_records(name) for name in kinds.transfer}
    inserted = dict.fromkeys(kinds.transfer, 0)
    with progress("migrate", sum(counts.values()), quiet=quiet) as bar:
        for name in kinds.transfer:
            bar.advance(copied[name].records)
            after = copied[name].after
            while rows := source.table_rows(name, after, BATCH_ROWS):
                now = target.insert_missing(name, rows)
                inserted[name] += now
                after = source.primary_key(name, rows[-1])
                bar.advance(now)
    if copied[kinds.sessions].records:  # copied by an earlier run: appended to since, perhaps
        after = None
        while sessions := source.table_rows(kinds.sessions, after, BATCH_ROWS):
            target.set_session_counts(sessions)
            after = source.primary_key(kinds.sessions, sessions[-1])
    target.finish_transfer()
    target.rebuild_fts()
    return inserted


def verify(source: OperatorBackend, target: OperatorBackend) -> dict[str, int]:
    """Record counts per kind, once each kind's count and checksum agree in both stores."""
    counts = {}
    for name in source.record_kinds().transfer:
        mine, theirs = source.table_digest(name), target.table_digest(name)
        if mine != theirs:
            raise MigrationMismatchError(
                f"after the copy, table {name} differs ({mine.rows} rows in the source, "
                f"{theirs.rows} in the target); run the migration again, and if it persists "
                "the target holds other state: migrate into an empty database."
            )
        counts[name] = mine.rows
    return counts


def migrate_command(args: argparse.Namespace, config: GatewayConfig) -> int:
    """``migrate --to URL``: both stores are opened for writing, so neither may be in use."""
    target_config = with_url(config, args.to)
    for path in backend_files(target_config):
        refuse_store_file(path, config, "to")
    if target_config.storage_url == config.storage_url:  # not echoed: it may hold a password
        raise InvalidValueError("to", "--to names the store to migrate from; name another one.")
    source = open_operator(config, write=True)
    try:
        copied = _check_before_writing(source, target_config)
        target = open_operator(target_config, write=True, plugins=None)
        try:
            if copied is None:
                copied = check_target(source, target)
            inserted = copy_tables(source, target, copied, quiet=args.json)
            counts = verify(source, target)
        finally:
            target.close()
    finally:
        source.close()
    if args.json:
        print_json({"copied": inserted, "verified": counts})
        return 0
    for name, count in counts.items():
        print(f"{name}: {count} rows ({inserted[name]} copied now)")
    print("verified: row counts and checksums match; point storage.url at the new store")
    return 0
