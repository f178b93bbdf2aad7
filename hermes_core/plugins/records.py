"""The values the plugin manager keeps and hands out.

Public: :class:`PluginInfo` (one plugin as ``list_plugins()`` shows it, with :class:`Provides` and
its :data:`PluginStatus`) and :class:`PlatformRegistry`. Internal to the manager: where a plugin
came from, the plugins that are not registered, what the registration hooks offered, and the
problems found in those offers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

from hermes_core.domain.errors import HermesError, UnknownPlatformError, shown
from hermes_core.domain.specs import (
    ConnectorSpec,
    EvictionPolicy,
    PlatformSpec,
    RecoveryStep,
    StoreSpec,
)

__all__ = [
    "NO_ORIGIN", "Absent", "Concern", "Offers", "Origin", "PlatformRegistry", "PluginInfo",
    "PluginStatus", "Problem", "Provides",
]  # fmt: skip

PluginStatus = Literal["loaded", "conflict", "failed", "disabled"]
"""``loaded``: in use; ``conflict``: claims something another plugin claims too; ``failed``: did
not import or register, or a registration hook raised; ``disabled``: in ``plugins.disable``."""

Concern = Literal["platforms", "stores", "recovery_steps", "eviction_policy", "connectors"]
"""What a problem concerns: the registrations of one kind (and the getter that raises it)."""


@dataclass(frozen=True)
class Provides:
    """What a plugin registers: platforms, storage URL schemes, recovery steps, eviction policy,
    connectors (by platform)."""

    platforms: tuple[str, ...] = ()
    schemes: tuple[str, ...] = ()
    steps: tuple[str, ...] = ()
    policy: str | None = None
    connectors: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line, e.g. ``platforms: local, signal; steps: clean_shutdown``."""
        parts = [
            f"{label}: {', '.join(names)}"
            for label, names in (
                ("platforms", self.platforms), ("schemes", self.schemes), ("steps", self.steps),
                ("policy", (self.policy,) if self.policy else ()),
                ("connectors", self.connectors),
            )
            if names
        ]  # fmt: skip
        return "; ".join(parts)


@dataclass(frozen=True)
class PluginInfo:
    """One plugin, as ``list_plugins()`` and ``hermes-sessions plugins`` show it.

    ``provides`` is what the plugin registers; for a disabled built-in, what it would register.
    ``problems`` says why the status is not ``loaded`` (and how to fix it).
    """

    name: str
    distribution: str | None
    version: str | None
    hooks: tuple[str, ...]
    builtin: bool
    status: PluginStatus
    provides: Provides
    problems: tuple[str, ...]
    replaced: tuple[tuple[str, str], ...] = ()
    """(platform, plugin): platforms this plugin registers with the generic rule that a plugin
    specific to the platform replaces (only the built-in ``platforms`` plugin's yield)."""


@dataclass(frozen=True)
class Origin:
    """Where a plugin came from: its distribution and version, and whether it is a built-in."""

    distribution: str | None
    version: str | None
    builtin: bool


NO_ORIGIN = Origin(None, None, False)


@dataclass(frozen=True)
class Absent:
    """A plugin that is not registered: disabled, or failed to import or register."""

    origin: Origin
    status: PluginStatus
    problem: str | None


@dataclass
class Offers:
    """What the registration hooks returned, per plugin, in pluggy's call order."""

    platforms: list[tuple[str, PlatformSpec]] = field(default_factory=list)
    stores: list[tuple[str, StoreSpec]] = field(default_factory=list)
    steps: list[tuple[str, RecoveryStep]] = field(default_factory=list)
    policies: list[tuple[str, EvictionPolicy]] = field(default_factory=list)
    connectors: list[tuple[str, ConnectorSpec]] = field(default_factory=list)
    failures: list[tuple[str, Concern, str]] = field(default_factory=list)
    """(plugin, concern, message) of each registration hook that raised or returned junk."""
    dropped: list[tuple[str, str]] = field(default_factory=list)
    """(plugin, platform) pairs left out by a ``plugins.disable: [plugin.platform]`` entry."""
    replaced: list[tuple[str, str, str]] = field(default_factory=list)
    """(generic plugin, platform, replacing plugin) of each generic platform that yielded."""
    problems: list[Problem] = field(default_factory=list)
    registry: PlatformRegistry | None = None
    """The platform registry built from ``platforms`` (once there is no platform problem)."""

    def yield_generic(self, generic: str) -> None:
        """Leave out each platform of the ``generic`` plugin that another plugin registers too,
        recording the first such plugin as its replacement: a specific plugin for a platform
        replaces the generic rule rather than conflicting with it."""
        specific: dict[str, str] = {}
        for plugin_name, spec in self.platforms:
            if plugin_name != generic:
                specific.setdefault(spec.name, plugin_name)
        kept = []
        for plugin_name, spec in self.platforms:
            if plugin_name == generic and spec.name in specific:
                self.replaced.append((plugin_name, spec.name, specific[spec.name]))
            else:
                kept.append((plugin_name, spec))
        self.platforms = kept

    def of(self, plugin_name: str) -> Provides:
        """What ``plugin_name`` provides."""
        policies = [policy.name for name, policy in self.policies if name == plugin_name]
        return Provides(
            platforms=tuple(spec.name for name, spec in self.platforms if name == plugin_name),
            schemes=tuple(
                s for name, spec in self.stores if name == plugin_name for s in spec.schemes
            ),
            steps=tuple(step.name for name, step in self.steps if name == plugin_name),
            policy=policies[0] if policies else None,
            connectors=tuple(c.platform for name, c in self.connectors if name == plugin_name),
        )


@dataclass(frozen=True)
class Problem:
    """A conflict, a registration failure (strict only) or an essential plugin lost."""

    concern: Concern
    plugins: tuple[str, ...]
    message: str
    error: type[HermesError]


class PlatformRegistry(Mapping[str, PlatformSpec]):
    """Registered platforms by name, with the plugin that owns each."""

    def __init__(self, specs: Mapping[str, PlatformSpec], owners: Mapping[str, str]) -> None:
        self._specs = dict(sorted(specs.items()))
        self.owners: Mapping[str, str] = dict(owners)

    def __getitem__(self, name: str) -> PlatformSpec:
        return self._specs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def require(self, name: str, *, field: str = "platform") -> PlatformSpec:
        """The spec of ``name``, or :class:`UnknownPlatformError` saying what to do."""
        spec = self._specs.get(name)
        if spec is None:
            known = ", ".join(self._specs) or "none"
            raise UnknownPlatformError(
                field,
                f"{field} {shown(name)} is not a registered platform (registered: {known}); "
                "install or enable the plugin that provides it, or fix the name.",
            )
        return spec

    @property
    def local_machine(self) -> tuple[str, ...]:
        """The platforms that are the machine running the agent (``PlatformSpec.local_machine``)."""
        return tuple(name for name, spec in self._specs.items() if spec.local_machine)
