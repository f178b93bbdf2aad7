"""Agents from configuration: ``agent.use`` names the agent, ``agent.options`` configure it, and
the console commands' ``--agent`` flag, when given, wins over ``agent.use``.

A name is an entry point of the group ``hermes.agents`` (the built-ins ``echo`` and ``openai``,
or one that an installed distribution registers) or an import string ``package.module:attr``
(imported with the current directory on the path, as ``python -m`` would). Whichever it is, the
object it names follows one rule, by the arguments it requires:

- two, ``(options, config)``: a *builder*, called once at start with ``agent.options`` and the
  :class:`~hermes_core.config.schema.GatewayConfig`; it returns the agent factory and raises a
  :class:`~hermes_core.domain.errors.ConfigError` for an option it refuses
  (:func:`agent_options` reads them);
- one: the agent factory itself (a class or function called with each lane's
  :class:`~hermes_core.domain.models.SessionEntry`), which takes no options.

A factory may also have an ``async aclose()`` method, which :meth:`LoadedAgent.aclose` awaits
when the host stops (to close a client that its agents share, say).
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from hermes_core.config.messages import config_error
from hermes_core.config.schema import AGENT_SPEC, GatewayConfig
from hermes_core.config.values import Section
from hermes_core.domain.errors import ConfigError, InvalidValueError
from hermes_core.domain.models import SessionEntry
from hermes_core.gateway.agents import EchoAgent
from hermes_core.gateway.runtime import AgentFactory

__all__ = [
    "ENTRY_POINT_GROUP", "AgentBuilder", "LoadedAgent", "agent_options", "echo_agents",
    "load_agent",
]  # fmt: skip

ENTRY_POINT_GROUP = "hermes.agents"
AgentBuilder = Callable[[Mapping[str, Any], GatewayConfig], AgentFactory]
"""What a builder is: ``(agent.options, config) -> agent factory``."""

OptionsT = TypeVar("OptionsT", bound=BaseModel)


@dataclass(frozen=True)
class LoadedAgent:
    """The agent that the configuration (or the flag) names: ``name`` as written, and the
    factory to give :class:`~hermes_core.gateway.runtime.Gateway`."""

    name: str
    factory: AgentFactory

    async def aclose(self) -> None:
        """Release what the factory holds (its ``aclose()``, if it has one); call it once the
        gateway has stopped."""
        close = getattr(self.factory, "aclose", None)
        if close is not None:
            await close()


@dataclass(frozen=True)
class _Choice:
    """Where the agent's name came from, for error messages."""

    spec: str
    flag: bool
    source: str

    def refuse(self, problem: str) -> InvalidValueError:
        """A named error: ``--agent 'x': problem`` or ``config.yaml: agent.use 'x': problem``."""
        if self.flag:
            return InvalidValueError("agent", f"--agent {self.spec!r}: {problem}")
        message = f"{self.source}: agent.use {self.spec!r}: {problem}"
        return ConfigError("agent.use", message, source=self.source)


def load_agent(config: GatewayConfig, override: str | None = None) -> LoadedAgent:
    """The agent named by ``override`` (the ``--agent`` flag) or else ``config.agent.use``.

    ``agent.options`` belong to ``agent.use``: a flag naming another agent gets none. Raises
    :class:`~hermes_core.domain.errors.InvalidValueError` for a bad flag and
    :class:`~hermes_core.domain.errors.ConfigError` for a bad configured name or option, each
    saying what to change.
    """
    source = config.source or "<defaults>"
    spec = config.agent.use if override is None else override
    choice = _Choice(spec, override is not None, source)
    same = override is None or override == config.agent.use
    options: Mapping[str, Any] = config.agent.options if same else {}
    if re.fullmatch(AGENT_SPEC, spec) is None:
        raise choice.refuse(
            "not an agent name; write an entry point name such as echo or openai, or an "
            "import string such as mybot:MyAgent"
        )
    target = _import(choice) if ":" in spec else _entry_point(choice)
    if not callable(target):
        raise choice.refuse(
            f"names a {type(target).__name__}, not something to call; name an agent factory "
            "taking the lane's SessionEntry, or a builder taking (options, config)"
        )
    required = _required_arguments(target)
    if required == 2:
        builder: AgentBuilder = target
        built = builder(options, config)
        if not callable(built):
            raise choice.refuse(
                f"is a builder that returned a {type(built).__name__}; a builder returns the "
                "agent factory, called with each lane's SessionEntry"
            )
        return LoadedAgent(spec, built)
    if required not in (1, None):
        raise choice.refuse(
            f"takes {required} required arguments; name an agent factory taking the lane's "
            "SessionEntry, or a builder taking (options, config)"
        )
    if options:
        raise choice.refuse(
            "is an agent factory, which takes no options; remove agent.options, or name a "
            "builder taking (options, config)"
        )
    factory: AgentFactory = target
    return LoadedAgent(spec, factory)


def agent_options(
    model: type[OptionsT], options: Mapping[str, Any], config: GatewayConfig
) -> OptionsT:
    """``options`` read into ``model`` (a pydantic model; give it ``extra="forbid"``); a refused
    value is a :class:`~hermes_core.domain.errors.ConfigError` naming ``agent.options.<key>``,
    the file and what is accepted, as the schema's own errors do."""
    try:
        return model.model_validate(dict(options))
    except ValidationError as exc:
        source = config.source or "<defaults>"
        raise config_error(exc, source, model, prefix=("agent", "options")) from None


def echo_agents(options: Mapping[str, Any], config: GatewayConfig) -> AgentFactory:
    """The ``echo`` builder: an :class:`~hermes_core.gateway.agents.EchoAgent` per lane; it
    takes no options."""
    agent_options(_NoOptions, options, config)

    def factory(entry: SessionEntry) -> EchoAgent:
        return EchoAgent()

    return factory


class _NoOptions(Section):
    """An agent without options: any key is refused."""


def _import(choice: _Choice) -> Any:
    """The object an import string names."""
    module_name, _, attr = choice.spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # any failure of the operator's module is reported
        raise choice.refuse(
            f"importing {module_name!r} failed ({exc!r}); check the module path and that it is "
            "installed or in the current directory"
        ) from exc
    for part in attr.split("."):
        if not hasattr(target, part):
            raise choice.refuse(
                f"{module_name!r} has no attribute {attr!r}; name a class, factory or builder "
                "defined there"
            )
        target = getattr(target, part)
    return target


def _entry_point(choice: _Choice) -> Any:
    """The object the entry point ``choice.spec`` of :data:`ENTRY_POINT_GROUP` names."""
    found = [entry for entry in entry_points(group=ENTRY_POINT_GROUP) if entry.name == choice.spec]
    if not found:
        names = sorted({entry.name for entry in entry_points(group=ENTRY_POINT_GROUP)})
        raise choice.refuse(
            f"no agent of that name in the entry point group {ENTRY_POINT_GROUP} (installed: "
            f"{', '.join(names) or 'none'}); check the spelling, install the distribution "
            "that provides it, or write an import string package.module:factory"
        )
    if len(found) > 1:
        owners = ", ".join(sorted(str(entry.value) for entry in found))
        raise choice.refuse(
            f"several installed distributions register it ({owners}); uninstall one, or write "
            "the import string of the one you mean"
        )
    try:
        return found[0].load()
    except Exception as exc:  # a broken distribution is reported, not a traceback
        raise choice.refuse(
            f"loading {found[0].value!r} failed ({exc!r}); reinstall the distribution that "
            "provides it"
        ) from exc


def _required_arguments(target: Any) -> int | None:
    """How many positional arguments ``target`` requires, or None when it cannot be told (a
    built-in without a signature: the first turn shows whether it works)."""
    try:
        parameters = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in parameters if p.kind in positional and p.default is p.empty)
