"""``doctor``'s one walk of the routing table: a page of :data:`ROUTE_PAGE` rows at a time
(:meth:`~hermes_core.store.operator.OperatorBackend.check_routes`), each page checked for rows
the store cannot read and for lanes whose session is missing or ended, and compared with
``sessions.json``. Only counts and the first few lines found are kept, so memory stays flat
however many lanes the store holds (the mirror file, when one is written, is read whole)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hermes_core.cli.common import Progress, store_spec
from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import ConfigError, PluginConflictError
from hermes_core.plugins.manager import HermesPluginManager
from hermes_core.store.mirror import load_mirror, writes_mirror
from hermes_core.store.operator import OperatorBackend

ROUTE_PAGE = 1_000
"""Routing rows read and checked at a time."""
SHOWN = 5
"""Lines a finding names; the rest are counted."""
PLUGIN_PROBLEM = (PluginConflictError, ConfigError)
"""What the plugin manager's getters raise for the problems of the ``plugins`` finding."""
NOT_CHECKED = "not checked: the plugins' problem above stops it"


@dataclass
class Finding:
    """One check's result: ``ok``, ``warn`` (worth knowing, not failing), ``problem`` or
    ``fixed``; ``fix`` says what repairs it (``--fix`` when doctor can)."""

    check: str
    status: str
    detail: str
    fix: str | None = None


@dataclass
class Lines:
    """Lines a check found: how many, and the first :data:`SHOWN`."""

    count: int = 0
    first: list[str] = field(default_factory=list)

    def add(self, lines: list[str]) -> None:
        self.count += len(lines)
        self.first += lines[: SHOWN - len(self.first)]

    def detail(self) -> str:
        """The first lines, ``; ``-joined, and how many more there are."""
        more = f" (and {self.count - SHOWN} more)" if self.count > SHOWN else ""
        return "; ".join(self.first) + more


class MirrorComparison:
    """``sessions.json`` against the routing table: the file is read before the walk, and
    each page of routing rows takes its lanes out of it (:meth:`see`); what differs is what
    the pages did not match and what the file still holds after the last."""

    def __init__(
        self, config: GatewayConfig, plugins: HermesPluginManager, *, running: bool
    ) -> None:
        self.path = config.sessions_dir / "sessions.json"
        self.running = running
        self.decided: Finding | None = None
        """The finding, when it does not depend on the routing table."""
        self.missing = False
        self.mirrored: dict[str, str] | None = None
        """The file's lanes not yet matched (session id by key), while it is compared."""
        self.differ = 0
        self.limit = config.gateway.sessions_json_max_lanes
        self.kept = False
        """A mirror is written for a store of this kind (up to :attr:`limit` lanes)."""
        if config.sessions_dir.is_symlink():
            self.decided = Finding(
                "mirror", "warn", "not read: the sessions directory is a symlink"
            )
            return
        try:
            if not writes_mirror(config, store_spec(config, plugins)):
                self.decided = Finding(
                    "mirror", "ok", "not written (gateway.write_sessions_json is off)"
                )
                return
            self.kept = True
            mirror = load_mirror(self.path, plugins)  # a missing file loads as empty, quietly
        except PLUGIN_PROBLEM:
            self.decided = Finding("mirror", "warn", NOT_CHECKED)
            return
        if not self.path.exists():
            self.missing = True
        elif mirror.problem is not None:
            self.decided = Finding("mirror", "problem", f"{self.path} {mirror.problem}",
                                   "--fix rewrites it")  # fmt: skip
        else:
            self.mirrored = {key: entry.session_id for key, entry in mirror.entries.items()}

    def see(self, lanes: list[tuple[str, str]]) -> None:
        """Match a page of the routing table's (session key, session id) pairs."""
        if self.mirrored is None:
            return
        for key, session_id in lanes:
            if self.mirrored.pop(key, None) != session_id:
                self.differ += 1

    def finding(self, lanes: int) -> Finding:
        """The finding once the walk has seen all ``lanes`` of the routing table."""
        if self.kept and lanes > self.limit:
            return self._past_limit(lanes)
        if self.decided is not None:
            return self.decided
        if self.missing:
            if not lanes:
                return Finding("mirror", "ok", "no lanes yet")
            return Finding("mirror", "problem", f"{self.path} is missing", "--fix rewrites it")
        differ = self.differ + len(self.mirrored or {})
        if not differ:
            return Finding("mirror", "ok", f"agrees with the routing table ({lanes} lanes)")
        detail = f"{self.path} disagrees with the routing table on {differ} lane(s)"
        if self.running:  # the gateway writes it at most once a minute
            return Finding("mirror", "warn", detail + " (the running gateway rewrites it soon)")
        return Finding("mirror", "problem", detail, "--fix rewrites it")

    def _past_limit(self, lanes: int) -> Finding:
        """A store past ``gateway.sessions_json_max_lanes``: no mirror is kept, and one left
        from before is outdated (the next write removes it)."""
        detail = (
            f"not written: {lanes} lanes, more than gateway.sessions_json_max_lanes ({self.limit})"
        )
        if not self.path.exists():
            return Finding("mirror", "ok", detail)
        detail += f"; {self.path} is left from before and outdated"
        if self.running:
            return Finding("mirror", "warn", detail + " (the running gateway removes it soon)")
        return Finding("mirror", "problem", detail, "--fix removes it")


@dataclass
class RouteWalk:
    """What the walk found: lanes, unreadable rows (queued events' too) and lanes whose
    session is missing or ended."""

    lanes: int = 0
    unreadable: Lines = field(default_factory=Lines)
    dangling: Lines = field(default_factory=Lines)

    def findings(self) -> list[Finding]:
        """The ``stored rows`` and ``routing`` findings."""
        return [
            Finding("stored rows", "problem", self.unreadable.detail(),
                    "ls, show, rekey and the gateway pass over them: restore them from a backup; "
                    "a lane's next message rewrites its entry (in a new session, the old one "
                    "stays stored); `hermes-sessions drop ID` deletes a dead-lettered event")
            if self.unreadable.count
            else Finding("stored rows", "ok", "every routing entry and queued event can be read"),
            Finding("routing", "warn", self.dangling.detail(), "`hermes-sessions reset KEY`")
            if self.dangling.count
            else Finding("routing", "ok", "every lane points at an open session"),
        ]  # fmt: skip


def walk_routes(
    backend: OperatorBackend, mirror: MirrorComparison, bar: Progress, page: int = ROUTE_PAGE
) -> RouteWalk:
    """Check every routing row, ``page`` at a time, advancing ``bar`` by each page's rows;
    then the queued events."""
    walk, after = RouteWalk(), None
    while (checks := backend.check_routes(after, page)).sessions:
        walk.lanes += len(checks.sessions)
        walk.unreadable.add(checks.unreadable)
        walk.dangling.add(checks.dangling)
        mirror.see(checks.sessions)
        bar.advance(len(checks.sessions))
        after = checks.sessions[-1][0]
    walk.unreadable.add(backend.unreadable_events())
    return walk
