"""``hermes-sessions migrate --to URL``: copy every kind of stored record (every table, for a SQL
store) to another store (SQLite to PostgreSQL or back), in batches keyed by primary key, each
batch one transaction that skips the records the target holds already; then rebuild the
full-text index there and verify each kind by record count and checksum. The source backend
names the kinds (:class:`~hermes_core.store.operator.RecordKinds`); the target must keep the
same ones.

A run that was interrupted (even killed) is resumed by running it again: its committed batches
stay, and the re-run walks the source again, inserting only what the target lacks, so every
record ends there once. Before writing anything it refuses a target that is one of the source's
own files (those its ``StoreSpec.files`` declares) or that holds anything but part of this
source's copy: a record the source lacks or holds otherwise means another store, or this store's
copy from before the source changed."""

from __future__ import annotations

import argparse
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


def check_target(source: OperatorBackend, target: OperatorBackend) -> None:
    """Raise :class:`ForeignTargetError` unless every row of ``target`` is a row of ``source``
    (an empty target, or one an interrupted migration of this source filled in part)."""
    kinds = source.record_kinds().transfer
    if target.record_kinds().transfer != kinds:
        raise ForeignTargetError(
            f"the target's {target.name} store keeps other kinds of record than this "
            f"{source.name} store; nothing was copied. Migrate into a store of a backend that "
            "keeps the same ones."
        )
    for name in kinds:
        after = None
        while rows := target.table_rows(name, after, BATCH_ROWS):
            foreign = source.foreign_rows(name, rows)
            if foreign:
                raise ForeignTargetError(
                    f"the target already holds another store ({foreign} row(s) of its table "
                    f"{name} are not rows of this one); nothing was copied. Migrate into an empty "
                    "database, or into the target of an interrupted migration of this same store."
                )
            after = target.primary_key(name, rows[-1])


def _check_before_writing(source: OperatorBackend, target_config: GatewayConfig) -> None:
    """:func:`check_target` on the target opened read-only, so that another store is refused
    before its writer lock is taken or its schema touched; a target that cannot be read as it
    is (nothing there yet, an older schema) is checked once opened for writing."""
    try:
        probe = open_operator(target_config, write=False, plugins=None)
    except StoreError:
        return
    try:
        check_target(source, probe)
    finally:
        probe.close()


def copy_tables(
    source: OperatorBackend, target: OperatorBackend, *, quiet: bool = False
) -> dict[str, int]:
    """Copy the records ``target`` lacks, kind by kind, a batch per transaction (a progress bar
    counts the source's records; ``quiet``: none); records inserted per kind.

    Called once :func:`check_target` passed: every record of the target is then one of the
    source's, so a kind with as many records in both is complete and is not walked again (a
    resumed run walks only the kinds the interrupted one had not finished)."""
    kinds = source.record_kinds()
    counts = {name: source.count_records(name) for name in kinds.transfer}
    inserted = dict.fromkeys(kinds.transfer, 0)
    with progress("migrate", sum(counts.values()), quiet=quiet) as bar:
        for name in kinds.transfer:
            if target.count_records(name) == counts[name]:
                bar.advance(counts[name])
                continue
            after = None
            while rows := source.table_rows(name, after, BATCH_ROWS):
                inserted[name] += target.insert_missing(name, rows)
                after = source.primary_key(name, rows[-1])
                bar.advance(len(rows))
    after = None
    while sessions := source.table_rows(kinds.sessions, after, BATCH_ROWS):
        target.set_session_counts(sessions)  # the count trigger moved them during the copy
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
        _check_before_writing(source, target_config)
        target = open_operator(target_config, write=True, plugins=None)
        try:
            check_target(source, target)
            inserted = copy_tables(source, target, quiet=args.json)
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
