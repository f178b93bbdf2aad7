"""What stops the plugins' offers from being used, each problem with a message that names the
plugins concerned and says which ``plugins.disable`` entry (or other change) fixes it.

A problem is a claim made by two plugins (a platform, a storage scheme, a recovery step, two
replacement eviction policies), an essential built-in disabled with nothing else providing what
it did, a ``plugins.disable`` entry naming a platform its plugin does not register, or (when
strict) a registration hook that failed. The plugin manager finds them once per set of offers and
raises them from its typed getters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import (
    ConfigError,
    HermesError,
    PlatformConflictError,
    PluginConflictError,
    PluginError,
)
from hermes_core.plugins.records import Concern, Offers, Problem, Provides

__all__ = ["find_problems"]


def find_problems(
    offers: Offers,
    config: GatewayConfig,
    *,
    describe: Callable[[str], str],
    is_builtin: Callable[[str], bool],
    has_plugin: Callable[[str], bool],
    essentials_disabled: Mapping[str, Provides],
    strict: bool,
) -> list[Problem]:
    """Conflicts, essential plugins disabled without a replacement, misnamed platform disables,
    and (when ``strict``) registration failures. ``describe`` names a plugin in messages,
    ``essentials_disabled`` maps each disabled essential built-in to what it would provide."""
    problems: list[Problem] = []
    claims: tuple[tuple[Concern, str, dict[str, list[str]]], ...] = (
        ("platforms", "platform", _owners((spec.name, p) for p, spec in offers.platforms)),
        ("stores", "storage scheme",
         _owners((scheme, p) for p, spec in offers.stores for scheme in spec.schemes)),
        ("recovery_steps", "recovery step", _owners((s.name, p) for p, s in offers.steps)),
        ("connectors", "connector for platform",
         _owners((c.platform, p) for p, c in offers.connectors)),
    )  # fmt: skip
    for concern, what, owners in claims:
        for claimed, plugins in owners.items():
            if len(plugins) > 1:
                problems.append(_conflict(concern, what, claimed, plugins, describe))
    replacing = [name for name, _ in offers.policies if not is_builtin(name)]
    if len(replacing) > 1:
        names = " and ".join(f"plugin {describe(name)}" for name in replacing)
        problems.append(
            Problem(
                "eviction_policy", tuple(replacing),
                f"only one eviction policy may replace the built-in one, but {names} each "
                f"offer one; {_disable_one(replacing)}.",
                PluginConflictError,
            )
        )  # fmt: skip
    problems += _lost(offers, config, essentials_disabled)
    problems += _misnamed_disables(offers, config, has_plugin)
    if strict:
        for plugin_name, concern, message in offers.failures:
            text = f"plugin {describe(plugin_name)}: {message}"
            problems.append(Problem(concern, (plugin_name,), text, PluginError))
    return problems


def _conflict(
    concern: Concern, what: str, claimed: str, plugins: list[str], describe: Callable[[str], str]
) -> Problem:
    """Two (or more) plugins claim one name: name them and say which entries fix it."""
    named = " and by plugin ".join(describe(name) for name in plugins)
    if concern == "platforms":
        fixes = " or ".join(f"[{name}.{claimed}]" for name in plugins)
        fix = f"disable it in one of them (plugins.disable: {fixes}) or disable one of the plugins"
        error: type[HermesError] = PlatformConflictError
    else:
        fix, error = _disable_one(plugins), PluginConflictError
    return Problem(
        concern, tuple(plugins), f"{what} {claimed!r} is registered by plugin {named}; {fix}.",
        error,
    )  # fmt: skip


def _lost(
    offers: Offers, config: GatewayConfig, essentials_disabled: Mapping[str, Provides]
) -> list[Problem]:
    """Essential built-ins disabled with nothing else providing what they did."""
    problems = []
    scheme = config.storage_url.split("://", 1)[0]
    for name, would in essentials_disabled.items():
        prefix = f"plugins.disable lists {name!r}, and no other plugin provides"
        fix = f"remove {name!r} from plugins.disable or install a plugin that"
        steps = {step.name for _, step in offers.steps}
        missing = [step for step in would.steps if step not in steps]
        if missing:
            problems.append(
                Problem(
                    "recovery_steps", (name,),
                    f"{prefix} the recovery steps {', '.join(missing)}: start-up and shutdown "
                    f"would skip them; {fix} registers steps with these names.",
                    ConfigError,
                )
            )  # fmt: skip
        schemes = {s for _, spec in offers.stores for s in spec.schemes}
        if scheme in would.schemes and scheme not in schemes:
            problems.append(
                Problem(
                    "stores", (name,),
                    f"{prefix} the storage backend for storage.url (scheme {scheme!r}): no "
                    f"session could be stored; {fix} registers the scheme {scheme!r}.",
                    ConfigError,
                )
            )  # fmt: skip
        if would.policy and not offers.policies:
            problems.append(
                Problem(
                    "eviction_policy", (name,),
                    f"{prefix} an eviction policy: the agent cache would have none; {fix} "
                    "offers one.",
                    ConfigError,
                )
            )  # fmt: skip
    return problems


def _misnamed_disables(
    offers: Offers, config: GatewayConfig, has_plugin: Callable[[str], bool]
) -> list[Problem]:
    """``plugins.disable: [plugin.platform]`` entries naming a platform the loaded plugin
    does not register (a typo would otherwise leave the platform silently enabled)."""
    problems = []
    for entry in config.plugins.disable:
        plugin_name, _, platform = entry.partition(".")
        if not platform or not has_plugin(plugin_name):
            continue
        offered = [*offers.of(plugin_name).platforms]
        offered += [name for owner, name in offers.dropped if owner == plugin_name]
        offered += [name for owner, name, _ in offers.replaced if owner == plugin_name]
        if platform not in offered:
            problems.append(
                Problem(
                    "platforms", (plugin_name,),
                    f"plugins.disable lists {entry!r}, but plugin {plugin_name!r} registers "
                    f"no platform {platform!r} (it registers: "
                    f"{', '.join(offered) or 'none'}); fix the entry.",
                    ConfigError,
                )
            )  # fmt: skip
    return problems


def _owners(claims: Iterator[tuple[str, str]]) -> dict[str, list[str]]:
    """Claimed name → the plugins claiming it, in call order."""
    owners: dict[str, list[str]] = {}
    for claimed, plugin_name in claims:
        owners.setdefault(claimed, []).append(plugin_name)
    return owners


def _disable_one(plugins: list[str]) -> str:
    """``disable one of them (plugins.disable: [a] or [b])``."""
    return f"disable one of them (plugins.disable: {' or '.join(f'[{p}]' for p in plugins)})"
