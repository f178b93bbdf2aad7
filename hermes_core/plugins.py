"""The plugin manager: built-ins, entry points, validation and typed getters.

Nothing outside this module calls ``pm.hook.*``: callers use the typed getters of
:class:`HermesPluginManager`. There is no global manager; :func:`create_plugin_manager` returns a
fresh one (the built-ins-only registry used when no manager is given is cached per ``HERMES_HOME``).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pluggy

from hermes_core.config import GatewayConfig
from hermes_core.errors import PlatformConflictError, PluginError, UnknownPlatformError
from hermes_core.specs import (
    EvictionPolicy,
    LifecycleEvent,
    PlatformSpec,
    RecoveryStep,
    StoreSpec,
)
from hermes_hookspecs import PROJECT_NAME, SPEC_MODULES

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "hermes.plugins"
"""Entry-point group through which built-in and third-party plugins are declared."""

DISTRIBUTION = "hermes-sessions"

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Marker for hook implementations: ``@hookimpl def hermes_register_platforms(config): ...``."""


@dataclass(frozen=True)
class PluginInfo:
    """One loaded plugin, as ``list_plugins()`` and ``hermes-sessions plugins`` show it."""

    name: str
    distribution: str | None
    version: str | None
    hooks: tuple[str, ...]
    builtin: bool


@dataclass(frozen=True)
class _Origin:
    distribution: str | None
    version: str | None
    builtin: bool


_NO_ORIGIN = _Origin(None, None, False)


def _who(plugin_name: str, distribution: str | None) -> str:
    """``'name' (distribution)``, how messages name a plugin."""
    return f"{plugin_name!r} ({distribution or 'not from a distribution'})"


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
                f"{field} {name!r} is not a registered platform (registered: {known}); install "
                "or enable the plugin that provides it, or fix the name.",
            )
        return spec


class HermesPluginManager(pluggy.PluginManager):
    """pluggy manager with typed, validated and cached access to the hermes hooks."""

    def __init__(self, config: GatewayConfig, *, strict: bool = False) -> None:
        super().__init__(PROJECT_NAME)
        self.config = config
        self.strict = strict
        self._origins: dict[str, _Origin] = {}
        self._platforms: PlatformRegistry | None = None

    # -- registration bookkeeping --------------------------------------------------------------

    def register(self, plugin: object, name: str | None = None) -> str | None:
        self._platforms = None
        return super().register(plugin, name)

    def unregister(self, plugin: object | None = None, name: str | None = None) -> Any:
        self._platforms = None
        return super().unregister(plugin, name)

    def _describe(self, plugin_name: str) -> str:
        """``'name' (distribution)`` of a registered plugin, for messages."""
        origin = self._origins.get(plugin_name, _NO_ORIGIN)
        return _who(plugin_name, origin.distribution)

    def _twice(self, what: str, first: str, second: str) -> str:
        """Message for a name two plugins claim, naming both plugins and distributions."""
        return (
            f"{what} is registered twice: by plugin {self._describe(first)} and by plugin "
            f"{self._describe(second)}; disable one of them (plugins.disable)."
        )

    def _fail(self, who: str, message: str) -> None:
        """A plugin problem: an error when strict, else a warning naming plugin and distribution."""
        text = f"plugin {who}: {message}"
        if self.strict:
            raise PluginError(text)
        logger.warning("%s; skipped", text)

    def _call_each(
        self, hook_name: str, **kwargs: Any
    ) -> Iterator[tuple[str, Any, Exception | None]]:
        """Call each implementation of ``hook_name`` separately, in registration order.

        Yields (plugin name, result, exception); exactly one of the last two is meaningful.
        """
        for impl in getattr(self.hook, hook_name).get_hookimpls():
            try:
                result = impl.function(*(kwargs[arg] for arg in impl.argnames))
            except Exception as exc:  # noqa: BLE001 - the caller applies the hook's failure policy
                yield impl.plugin_name, None, exc
            else:
                yield impl.plugin_name, result, None

    def _collect_specs(self, hook_name: str, kind: type[Any]) -> Iterator[tuple[str, Any]]:
        """Collect a list-returning registration hook, checking every item's type."""
        for plugin_name, result, error in self._call_each(hook_name, config=self.config):
            if error is not None:
                self._fail(self._describe(plugin_name), f"hook {hook_name} raised {error!r}")
                continue
            items = list(result) if isinstance(result, (list, tuple)) else None
            if items is None or not all(isinstance(item, kind) for item in items):
                message = f"hook {hook_name} must return a list of {kind.__name__}"
                self._fail(self._describe(plugin_name), message)
                continue
            for item in items:
                yield plugin_name, item

    # -- typed getters ----------------------------------------------------------------------------

    def platforms(self) -> PlatformRegistry:
        """The platform registry (cached until a plugin is registered or unregistered)."""
        if self._platforms is None:
            specs: dict[str, PlatformSpec] = {}
            owners: dict[str, str] = {}
            for plugin_name, spec in self._collect_specs("hermes_register_platforms", PlatformSpec):
                if spec.name in specs:
                    raise PlatformConflictError(
                        self._twice(f"platform {spec.name!r}", owners[spec.name], plugin_name)
                    )
                specs[spec.name] = spec
                owners[spec.name] = plugin_name
            self._platforms = PlatformRegistry(specs, owners)
        return self._platforms

    def stores(self) -> dict[str, StoreSpec]:
        """Storage backends by URL scheme; a scheme claimed twice is a :class:`PluginError`."""
        by_scheme: dict[str, tuple[str, StoreSpec]] = {}
        for plugin_name, spec in self._collect_specs("hermes_register_stores", StoreSpec):
            for scheme in spec.schemes:
                if scheme in by_scheme:
                    raise PluginError(
                        self._twice(f"storage scheme {scheme!r}", by_scheme[scheme][0], plugin_name)
                    )
                by_scheme[scheme] = (plugin_name, spec)
        return {scheme: spec for scheme, (_, spec) in by_scheme.items()}

    def recovery_steps(self, phase: str = "startup") -> list[RecoveryStep]:
        """Recovery steps of ``phase`` in run order (ascending order, ties by name)."""
        seen: dict[str, str] = {}
        steps: list[RecoveryStep] = []
        for plugin_name, step in self._collect_specs(
            "hermes_register_recovery_steps", RecoveryStep
        ):
            if step.name in seen:
                raise PluginError(
                    self._twice(f"recovery step {step.name!r}", seen[step.name], plugin_name)
                )
            seen[step.name] = plugin_name
            if step.phase == phase:
                steps.append(step)
        return sorted(steps, key=lambda step: (step.order, step.name))

    def eviction_policy(self) -> EvictionPolicy | None:
        """The active eviction policy: the one non-built-in offer if any, else the built-in one."""
        builtin: EvictionPolicy | None = None
        offered: list[tuple[str, EvictionPolicy]] = []
        for plugin_name, policy, error in self._call_each(
            "hermes_eviction_policy", config=self.config
        ):
            if error is not None or not isinstance(policy, (EvictionPolicy, type(None))):
                problem = f"raised {error!r}" if error else "must return an EvictionPolicy or None"
                self._fail(self._describe(plugin_name), f"hook hermes_eviction_policy {problem}")
            elif policy is None:
                continue
            elif self._origins.get(plugin_name, _NO_ORIGIN).builtin:
                builtin = policy
            else:
                offered.append((plugin_name, policy))
        if len(offered) > 1:
            names = " and ".join(f"plugin {self._describe(name)}" for name, _ in offered)
            raise PluginError(f"only one eviction policy may replace the built-in one: {names}.")
        return offered[0][1] if offered else builtin

    @property
    def observing(self) -> bool:
        """Whether any lifecycle observer is registered (callers skip building events if not)."""
        return bool(self.hook.hermes_on_lifecycle_event.get_hookimpls())

    def notify(self, event: LifecycleEvent) -> None:
        """Tell every observer about ``event``; an observer's exception is logged and ignored."""
        for plugin_name, _, error in self._call_each("hermes_on_lifecycle_event", event=event):
            if error is not None:
                logger.error(
                    "lifecycle observer %s failed on %s: %r",
                    self._describe(plugin_name), event.kind, error, exc_info=error,
                )  # fmt: skip

    def list_plugins(self) -> list[PluginInfo]:
        """Every registered plugin with its distribution, version, hooks and built-in flag."""
        infos = []
        for name, plugin in self.list_name_plugin():
            if plugin is None:  # blocked names stay listed by pluggy with a None plugin
                continue
            origin = self._origins.get(name, _NO_ORIGIN)
            hooks = tuple(sorted(caller.name for caller in self.get_hookcallers(plugin) or ()))
            infos.append(
                PluginInfo(name, origin.distribution, origin.version, hooks, origin.builtin)
            )
        return infos

    def add_plugin(
        self, plugin: object, name: str, *, distribution: str | None, version: str | None,
        builtin: bool = False,
    ) -> bool:  # fmt: skip
        """Register ``plugin`` after checking it implements only known hooks; False if skipped."""
        who = _who(name, distribution)
        if self.has_plugin(name):
            self._fail(who, f"the name is already used by plugin {self._describe(name)}")
            return False
        try:
            self.register(plugin, name=name)
        except Exception as exc:  # noqa: BLE001 - pluggy validation errors
            self._fail(who, f"could not be registered: {exc}")
            return False
        self._origins[name] = _Origin(distribution, version, builtin)
        unknown = sorted(c.name for c in self.get_hookcallers(plugin) or () if c.spec is None)
        if unknown:
            self.unregister(plugin)
            self._fail(who, f"implements unknown hooks {', '.join(unknown)} (misspelled?)")
            return False
        return True


def create_plugin_manager(
    config: GatewayConfig | None = None, *, load_entrypoints: bool = True, strict: bool = False
) -> HermesPluginManager:
    """A fresh, validated plugin manager: built-ins first, then entry-point plugins.

    ``config`` None loads ``$HERMES_HOME/config.yaml`` (if present) and the environment. Plugins in
    ``plugins.disable`` are not registered; entry points are skipped when ``load_entrypoints`` or
    ``plugins.autoload`` is false. A third-party plugin that fails to import or register is logged
    and skipped (a :class:`PluginError` when ``strict``); a platform claimed twice always raises
    :class:`PlatformConflictError`.
    """
    from hermes_plugins import BUILTIN_PLUGINS

    config = config if config is not None else GatewayConfig.load()
    manager = HermesPluginManager(config, strict=strict)
    for module_name in SPEC_MODULES:
        manager.add_hookspecs(importlib.import_module(module_name))
    disabled = set(config.plugins.disable)
    version = _own_version()
    builtin_names = set()
    for name, module_path in BUILTIN_PLUGINS:
        builtin_names.add(name)
        if name not in disabled:
            manager.add_plugin(
                importlib.import_module(module_path), name,
                distribution=DISTRIBUTION, version=version, builtin=True,
            )  # fmt: skip
    if load_entrypoints and config.plugins.autoload:
        for entry in entry_points(group=ENTRY_POINT_GROUP):
            dist = entry.dist.name if entry.dist is not None else None
            if entry.name in disabled or (entry.name in builtin_names and dist == DISTRIBUTION):
                continue
            try:
                plugin = entry.load()
            except Exception as exc:  # noqa: BLE001 - a broken third-party plugin is skipped
                manager._fail(_who(entry.name, dist), f"failed to import {entry.value!r}: {exc!r}")
                continue
            manager.add_plugin(
                plugin, entry.name, distribution=dist,
                version=entry.dist.version if entry.dist is not None else None,
            )  # fmt: skip
    manager.platforms()
    return manager


def _own_version() -> str | None:
    """The installed version of hermes-sessions (None when running from an uninstalled tree)."""
    from hermes_core import __version__

    return __version__


def platform_registry(
    plugins: HermesPluginManager | None = None, *, hermes_home: Path | None = None
) -> PlatformRegistry:
    """The platforms of ``plugins``; when None, the built-in platforms for ``hermes_home``
    (default ``$HERMES_HOME``; WhatsApp reads its mapping files there)."""
    if plugins is not None:
        return plugins.platforms()
    home = str(hermes_home) if hermes_home is not None else os.environ.get("HERMES_HOME", "")
    return _builtin_registry(home)


@functools.lru_cache(maxsize=8)
def _builtin_registry(hermes_home: str) -> PlatformRegistry:
    """Built-in platforms for one state directory, cached (no entry points, nothing disabled)."""
    environ = {"HERMES_HOME": hermes_home} if hermes_home else {}
    config = GatewayConfig.from_dict({}, source="<built-in defaults>", environ=environ)
    return create_plugin_manager(config, load_entrypoints=False, strict=True).platforms()
