"""The plugin manager: built-ins, entry points, validation and typed getters.

Nothing outside this module calls ``pm.hook.*``: callers use the typed getters of
:class:`HermesPluginManager`. :func:`create_plugin_manager` returns a fresh manager; every public
function's ``plugins=None`` means :func:`default_plugin_manager`, one cached manager per
configuration. The values the manager hands out (:class:`PluginInfo`, :class:`PlatformRegistry`)
are defined in :mod:`hermes_core.plugins.records`, the problems it raises are found by
:mod:`hermes_core.plugins.problems`.

The manager and the functions that build it stay in one module on purpose: building a manager
records the disabled and failed plugins in the manager's own bookkeeping.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, entry_points, version
from typing import Any

import pluggy
from cachetools import LRUCache

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import ConfigError, PluginError
from hermes_core.domain.specs import (
    ConnectorSpec,
    EvictionPolicy,
    LifecycleEvent,
    PlatformSpec,
    RecoveryStep,
    StoreSpec,
)
from hermes_core.plugins.problems import find_problems
from hermes_core.plugins.records import (
    NO_ORIGIN,
    Absent,
    Concern,
    Offers,
    Origin,
    PlatformRegistry,
    PluginInfo,
    PluginStatus,
    Provides,
)
from hermes_hookspecs import PROJECT_NAME, SPEC_MODULES
from hermes_plugins import BUILTIN_PLUGINS, ESSENTIAL_PLUGINS, GENERIC_PLATFORMS_PLUGIN

__all__ = [
    "DISTRIBUTION", "ENTRY_POINT_GROUP", "HermesPluginManager", "PlatformRegistry", "PluginInfo",
    "create_plugin_manager", "default_plugin_manager", "hookimpl", "platform_registry",
]  # fmt: skip

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "hermes.plugins"
"""Entry-point group through which built-in and third-party plugins are declared."""

DISTRIBUTION = "hermes-sessions"

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Marker for hook implementations: ``@hookimpl def hermes_register_platforms(config): ...``."""


def _who(plugin_name: str, distribution: str | None) -> str:
    """``'name' (distribution)``, how messages name a plugin."""
    return f"{plugin_name!r} ({distribution or 'not from a distribution'})"


class HermesPluginManager(pluggy.PluginManager):
    """pluggy manager with typed, validated and cached access to the hermes hooks.

    Each hook implementation is called on its own, in pluggy's call order (the last registered
    first; ``tryfirst``/``trylast`` move it to the front/back), so a failure is attributed to its
    plugin and isolated; pluggy's tracing and monitoring see each call. Hook wrappers
    (``wrapper=True``, ``hookwrapper=True``) are refused at registration: there is no single hook
    call for them to wrap.
    """

    def __init__(self, config: GatewayConfig, *, strict: bool = False) -> None:
        super().__init__(PROJECT_NAME)
        for module_name in SPEC_MODULES:
            self.add_hookspecs(importlib.import_module(module_name))
        self.config = config
        self.strict = strict
        self._origins: dict[str, Origin] = {}
        self._absent: dict[str, Absent] = {}
        self._order: dict[str, None] = {}
        """Every plugin name seen (registered or absent), in the order it was seen."""
        self._essentials_disabled: dict[str, Provides] = {}
        """Disabled essential built-ins and what they would have provided."""
        self._offered: Offers | None = None

    # -- registration --------------------------------------------------------------------------

    def register(self, plugin: object, name: str | None = None) -> str | None:
        """Register ``plugin`` (pluggy's checks), then refuse hook wrappers and unknown hooks
        (a misspelling) with a :class:`PluginError` naming the plugin; the plugin is then not
        registered."""
        registered = super().register(plugin, name)
        if registered is None:  # a blocked name
            return None
        problems = []
        for caller in self.get_hookcallers(plugin) or ():
            for impl in caller.get_hookimpls():
                if impl.plugin is not plugin:
                    continue
                if impl.wrapper or impl.hookwrapper:
                    problems.append(
                        f"implements {caller.name} as a hook wrapper, which hermes does not "
                        "support (each implementation is called on its own); remove "
                        "wrapper=True / hookwrapper=True"
                    )
                elif caller.spec is None and not impl.optionalhook:
                    problems.append(f"implements unknown hooks {caller.name} (misspelled?)")
        if problems:
            super().unregister(plugin)
            raise PluginError(f"plugin {registered!r} {'; '.join(problems)}.")
        self._order[registered] = None
        self._offered = None
        return registered

    def unregister(self, plugin: object | None = None, name: str | None = None) -> Any:
        self._offered = None
        return super().unregister(plugin, name)

    def add_plugin(
        self, plugin: object, name: str, *, distribution: str | None, version: str | None,
        builtin: bool = False,
    ) -> bool:  # fmt: skip
        """Register ``plugin`` from a distribution; False (status ``failed``) if refused."""
        origin = Origin(distribution, version, builtin)
        if self.has_plugin(name) or name in self._absent:
            self._fail(name, origin, f"the name is already used by plugin {self._describe(name)}")
            return False
        try:
            self.register(plugin, name=name)
        except Exception as exc:  # noqa: BLE001 - pluggy's and our validation errors
            self._fail(name, origin, f"could not be registered: {exc}")
            return False
        self._origins[name] = origin
        return True

    def _add_absent(
        self, name: str, origin: Origin, status: PluginStatus, problem: str | None
    ) -> None:
        """Record a plugin that is not registered (disabled, or failed to import)."""
        self._absent.setdefault(name, Absent(origin, status, problem))
        self._order[name] = None

    def _fail(self, name: str, origin: Origin, message: str) -> None:
        """A plugin that cannot be registered: a :class:`PluginError` when strict, else a
        warning naming plugin and distribution, and the plugin is listed as ``failed``."""
        text = f"plugin {_who(name, origin.distribution)}: {message}"
        if self.strict:
            raise PluginError(text)
        logger.warning("%s; skipped", text)
        self._add_absent(name, origin, "failed", message)

    def _describe(self, plugin_name: str) -> str:
        """``'name' (distribution)`` of a known plugin, for messages."""
        absent = self._absent.get(plugin_name)
        origin = absent.origin if absent else self._origins.get(plugin_name, NO_ORIGIN)
        return _who(plugin_name, origin.distribution)

    # -- collecting what the plugins offer -----------------------------------------------------

    def _call_each(
        self, hook_name: str, **kwargs: Any
    ) -> Iterator[tuple[str, Any, Exception | None]]:
        """Call each implementation of ``hook_name`` on its own, in pluggy's call order, through
        a pluggy hook caller that leaves out the other plugins (so that pluggy's tracing and
        :meth:`add_hookcall_monitoring` see every call, attributed to its plugin).

        Yields (plugin name, result, exception); exactly one of the last two is meaningful.
        """
        impls = getattr(self.hook, hook_name).get_hookimpls()
        for impl in reversed(impls):
            others = [other.plugin for other in impls if other is not impl]
            try:
                results = self.subset_hook_caller(hook_name, others)(**kwargs)
            except Exception as exc:  # noqa: BLE001 - the caller applies the hook's failure policy
                yield impl.plugin_name, None, exc
            else:  # pluggy leaves a None result out of the list
                yield impl.plugin_name, results[0] if results else None, None

    def _offers(self) -> Offers:
        """What every registration hook returned (cached until a plugin is (un)registered).

        A hook that raises or returns the wrong type is logged with the plugin's name and its
        offers are dropped; the plugin is listed as ``failed`` (with ``strict``, an error).
        """
        if self._offered is not None:
            return self._offered
        offers = Offers()
        disabled = set(self.config.plugins.disable)

        def failed(plugin_name: str, concern: Concern, message: str) -> None:
            offers.failures.append((plugin_name, concern, message))
            logger.warning("plugin %s: %s; skipped", self._describe(plugin_name), message)

        lists: tuple[tuple[Concern, str, type[Any], list[Any]], ...] = (
            ("platforms", "hermes_register_platforms", PlatformSpec, offers.platforms),
            ("stores", "hermes_register_stores", StoreSpec, offers.stores),
            ("recovery_steps", "hermes_register_recovery_steps", RecoveryStep, offers.steps),
            ("connectors", "hermes_register_connectors", ConnectorSpec, offers.connectors),
        )
        for concern, hook_name, kind, into in lists:
            for plugin_name, result, error in self._call_each(hook_name, config=self.config):
                if error is not None:
                    failed(plugin_name, concern, f"hook {hook_name} raised {error!r}")
                    continue
                items = list(result) if isinstance(result, (list, tuple)) else None
                if items is None or not all(isinstance(item, kind) for item in items):
                    message = f"hook {hook_name} must return a list of {kind.__name__}"
                    failed(plugin_name, concern, message)
                    continue
                for item in items:
                    if kind is PlatformSpec and f"{plugin_name}.{item.name}" in disabled:
                        offers.dropped.append((plugin_name, item.name))
                    else:
                        into.append((plugin_name, item))
        if self._is_builtin(GENERIC_PLATFORMS_PLUGIN):
            offers.yield_generic(GENERIC_PLATFORMS_PLUGIN)
        for plugin_name, policy, error in self._call_each(
            "hermes_eviction_policy", config=self.config
        ):
            if error is not None or not isinstance(policy, (EvictionPolicy, type(None))):
                problem = f"raised {error!r}" if error else "must return an EvictionPolicy or None"
                failed(plugin_name, "eviction_policy", f"hook hermes_eviction_policy {problem}")
            elif policy is not None:
                offers.policies.append((plugin_name, policy))
        offers.problems = find_problems(
            offers, self.config,
            describe=self._describe, is_builtin=self._is_builtin, has_plugin=self.has_plugin,
            essentials_disabled=self._essentials_disabled, strict=self.strict,
        )  # fmt: skip
        self._offered = offers
        return offers

    def _is_builtin(self, plugin_name: str) -> bool:
        return self._origins.get(plugin_name, NO_ORIGIN).builtin

    def _raise_for(self, concern: Concern) -> None:
        """Raise the error for ``concern``'s problems (all of them named), if any."""
        problems = [problem for problem in self._offers().problems if problem.concern == concern]
        if not problems:
            return
        message = " Also: ".join(problem.message for problem in problems)
        kind = problems[0].error
        if kind is ConfigError:
            raise ConfigError("plugins.disable", message, source=self.config.source)
        raise kind(message)

    def check(self) -> None:
        """Raise the first problem that would stop the plugins from being used: a conflict
        (:class:`PluginConflictError`, :class:`PlatformConflictError` for platforms), an
        essential plugin disabled without a replacement or a misnamed ``plugins.disable`` entry
        (:class:`ConfigError`), or, when strict, a registration hook that failed."""
        for concern in ("platforms", "stores", "recovery_steps", "eviction_policy", "connectors"):
            self._raise_for(concern)

    def problems(self) -> list[str]:
        """Every problem :meth:`check` would raise (the first concern's), one message each,
        naming the plugins concerned and the change that fixes it; ``[]`` when there is none."""
        return [problem.message for problem in self._offers().problems]

    # -- typed getters ----------------------------------------------------------------------------

    def platforms(self) -> PlatformRegistry:
        """The platform registry (cached until a plugin is registered or unregistered)."""
        offers = self._offers()
        if offers.registry is None:
            self._raise_for("platforms")
            offers.registry = PlatformRegistry(
                {spec.name: spec for _, spec in offers.platforms},
                {spec.name: plugin_name for plugin_name, spec in offers.platforms},
            )
        return offers.registry

    def stores(self) -> dict[str, StoreSpec]:
        """Storage backends by URL scheme."""
        self._raise_for("stores")
        return {scheme: spec for _, spec in self._offers().stores for scheme in spec.schemes}

    def store_plugin(self, spec: StoreSpec) -> str:
        """The name of the plugin that registered ``spec`` (one of :meth:`stores`)."""
        return next(name for name, offered in self._offers().stores if offered is spec)

    def connectors(self) -> dict[str, ConnectorSpec]:
        """Connectors by platform name."""
        self._raise_for("connectors")
        return {spec.platform: spec for _, spec in self._offers().connectors}

    def recovery_steps(self, phase: str = "startup") -> list[RecoveryStep]:
        """Recovery steps of ``phase`` in run order (ascending order, ties by name)."""
        self._raise_for("recovery_steps")
        steps = [step for _, step in self._offers().steps if step.phase == phase]
        return sorted(steps, key=lambda step: (step.order, step.name))

    def eviction_policy(self) -> EvictionPolicy | None:
        """The active eviction policy: the one non-built-in offer if any, else the built-in one."""
        self._raise_for("eviction_policy")
        offers = self._offers().policies
        replacing = [policy for name, policy in offers if not self._is_builtin(name)]
        active = replacing or [policy for name, policy in offers if self._is_builtin(name)]
        return active[0] if active else None

    @property
    def observing(self) -> bool:
        """Whether any lifecycle observer is registered (callers skip building events if not)."""
        return bool(self.hook.hermes_on_lifecycle_event.get_hookimpls())

    def notify(self, event: LifecycleEvent) -> None:
        """Tell every observer about ``event`` in pluggy's call order; an observer's exception is
        logged with its plugin's name and the next observer runs."""
        for plugin_name, _, error in self._call_each("hermes_on_lifecycle_event", event=event):
            if error is not None:
                logger.error(
                    "lifecycle observer %s failed on %s: %r",
                    self._describe(plugin_name), event.kind, error, exc_info=error,
                )  # fmt: skip

    def list_plugins(self) -> list[PluginInfo]:
        """Every plugin seen, registered or not, in the order seen (built-ins first), with its
        status, what it provides and its problems. Never raises."""
        offers = self._offers()
        problems = offers.problems
        registered = {name: plugin for name, plugin in self.list_name_plugin() if plugin}
        infos = []
        for name in self._order:
            absent = self._absent.get(name)
            if absent is not None:
                provides = self._essentials_disabled.get(name, Provides())
                notes = [absent.problem] if absent.problem else []
                notes += [p.message for p in problems if name in p.plugins]
                infos.append(
                    PluginInfo(
                        name, absent.origin.distribution, absent.origin.version, (),
                        absent.origin.builtin, absent.status, provides, tuple(notes),
                    )
                )  # fmt: skip
                continue
            plugin = registered.get(name)
            if plugin is None:  # unregistered since
                continue
            origin = self._origins.get(name, NO_ORIGIN)
            hooks = tuple(sorted(caller.name for caller in self.get_hookcallers(plugin) or ()))
            failures = [message for owner, _, message in offers.failures if owner == name]
            conflicts = [p.message for p in problems if name in p.plugins]
            status: PluginStatus = "conflict" if conflicts else "failed" if failures else "loaded"
            replaced = tuple((platform, by) for of, platform, by in offers.replaced if of == name)
            infos.append(
                PluginInfo(
                    name, origin.distribution, origin.version, hooks, origin.builtin, status,
                    offers.of(name), tuple(conflicts + failures), replaced,
                )
            )  # fmt: skip
        return infos


def create_plugin_manager(
    config: GatewayConfig | None = None,
    *,
    load_entrypoints: bool = True,
    strict: bool = False,
    check: bool = True,
) -> HermesPluginManager:
    """A fresh plugin manager: built-ins first, then entry-point plugins, then :meth:`check`.

    ``config`` None loads ``$HERMES_HOME/config.yaml`` (if present) and the environment. Plugins in
    ``plugins.disable`` are not registered (``<plugin>.<platform>`` drops one platform of a
    plugin); entry points are skipped when ``load_entrypoints`` or ``plugins.autoload`` is false.
    A third-party plugin that fails to import or register is logged and skipped (a
    :class:`PluginError` when ``strict``). With ``check`` false, conflicts and lost essential
    plugins are not raised: :meth:`HermesPluginManager.list_plugins` shows them, and each typed
    getter still raises for its own concern.
    """
    config = config if config is not None else GatewayConfig.load()
    manager = HermesPluginManager(config, strict=strict)
    disabled = set(config.plugins.disable)
    version = _own_version()
    for name, module_path in BUILTIN_PLUGINS:
        origin = Origin(DISTRIBUTION, version, True)
        if name in disabled:
            manager._add_absent(name, origin, "disabled", None)
            if name in ESSENTIAL_PLUGINS:
                manager._essentials_disabled[name] = _would_provide(config, name, module_path)
            continue
        manager.add_plugin(
            importlib.import_module(module_path), name,
            distribution=DISTRIBUTION, version=version, builtin=True,
        )  # fmt: skip
    if load_entrypoints and config.plugins.autoload:
        builtin_names = {name for name, _ in BUILTIN_PLUGINS}
        for entry in entry_points(group=ENTRY_POINT_GROUP):
            dist = entry.dist.name if entry.dist is not None else None
            if entry.name in builtin_names and dist == DISTRIBUTION:
                continue
            origin = Origin(dist, entry.dist.version if entry.dist is not None else None, False)
            if entry.name in disabled:
                manager._add_absent(entry.name, origin, "disabled", None)
                continue
            try:
                plugin = entry.load()
            except Exception as exc:  # noqa: BLE001 - a broken third-party plugin is skipped
                manager._fail(entry.name, origin, f"failed to import {entry.value!r}: {exc!r}")
                continue
            manager.add_plugin(
                plugin, entry.name, distribution=origin.distribution, version=origin.version
            )
    if check:
        manager.check()
    return manager


def _would_provide(config: GatewayConfig, name: str, module_path: str) -> Provides:
    """What the built-in plugin ``name`` registers when enabled (shown while it is disabled)."""
    alone = HermesPluginManager(config)
    alone.register(importlib.import_module(module_path), name=name)
    return alone._offers().of(name)


@functools.cache
def _own_version() -> str | None:
    """The installed version of hermes-sessions (None when running from an uninstalled tree)."""
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return None


def default_plugin_manager(config: GatewayConfig | None = None) -> HermesPluginManager:
    """The manager every ``plugins=None`` stands for: built-ins and entry points, checked, not
    strict, for ``config`` (None: ``$HERMES_HOME/config.yaml`` and the environment, read once per
    state directory). Built once and cached: equal configurations share one manager."""
    if config is None:
        config = _process_config(os.environ.get("HERMES_HOME", ""))
    known = _BY_IDENTITY.get(id(config))
    if known is not None and known[0] is config:  # the same object again (the common case)
        return known[1]
    key = config.model_dump_json()
    manager = _DEFAULT_MANAGERS.get(key)
    if manager is None:
        manager = _DEFAULT_MANAGERS.setdefault(key, create_plugin_manager(config))
    _BY_IDENTITY[id(config)] = (config, manager)  # holds config, so its id stays its own
    return manager


@functools.lru_cache(maxsize=8)
def _process_config(hermes_home: str) -> GatewayConfig:
    """The process's configuration for one ``$HERMES_HOME`` (the argument is the cache key)."""
    return GatewayConfig.load()


_DEFAULT_MANAGERS: LRUCache[str, HermesPluginManager] = LRUCache(maxsize=8)
"""Default managers by the JSON of their configuration."""
_BY_IDENTITY: LRUCache[int, tuple[GatewayConfig, HermesPluginManager]] = LRUCache(maxsize=32)
"""The default manager of recently seen configuration objects, without serialising them."""


def platform_registry(
    plugins: HermesPluginManager | None = None, config: GatewayConfig | None = None
) -> PlatformRegistry:
    """The platforms of ``plugins``, or of :func:`default_plugin_manager` for ``config``."""
    return (plugins if plugins is not None else default_plugin_manager(config)).platforms()
