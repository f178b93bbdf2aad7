"""hermes-sessions: session lifecycle for chat-agent gateways.

The public API is :data:`__all__`; plugins implement hooks with :data:`hookimpl`. Every public
name (``__version__`` included) is imported on first use, so importing ``hermes_core`` loads
only what is used: a platform plugin does not load the runtime or the store, and
``hermes-sessions --version`` loads neither pydantic nor SQLAlchemy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    __version__: str | None
    from hermes_core.config.schema import GatewayConfig
    from hermes_core.domain.connectors import (
        Connector,
        ConnectorContext,
        Inbox,
        WebhookRoute,
        WebRequest,
        WebResponse,
    )
    from hermes_core.domain.errors import (
        ConfigError,
        GatewayLockedError,
        HermesError,
        InvalidValueError,
        MalformedEventError,
        MessageNotStoredError,
        PlatformConflictError,
        PluginConflictError,
        PluginError,
        RedactionError,
        StoreError,
        UnknownPlatformError,
    )
    from hermes_core.domain.keys import (
        KeyResolution,
        SessionKeyParts,
        build_key_from_flags,
        build_session_key,
        is_shared_multi_user_session,
        parse_session_key,
        resolve_key,
        resolve_key_from_flags,
        resolve_session_key,
    )
    from hermes_core.domain.models import (
        HomeChannel,
        MessageEvent,
        MessageType,
        SessionContext,
        SessionEntry,
        SessionSource,
    )
    from hermes_core.domain.specs import (
        ConnectorSpec,
        EvictionCandidate,
        EvictionPolicy,
        LifecycleEvent,
        PlatformSpec,
        ReadContext,
        RecoveryContext,
        RecoveryReport,
        RecoveryStep,
        StoreSpec,
    )
    from hermes_core.domain.splitting import split_reply, utf16_len
    from hermes_core.gateway.agent_loading import LoadedAgent, agent_options, load_agent
    from hermes_core.gateway.agents import (
        Adapter,
        Agent,
        EchoAgent,
        EditingAdapter,
        HostCallbacks,
        InMemoryAdapter,
        Posted,
        TurnRequest,
        TypingAdapter,
    )
    from hermes_core.gateway.context import (
        build_session_context,
        build_session_context_prompt,
        prefix_sender,
    )
    from hermes_core.gateway.runtime import Gateway
    from hermes_core.plugins.events import read_event
    from hermes_core.plugins.manager import (
        HermesPluginManager,
        PlatformRegistry,
        PluginInfo,
        create_plugin_manager,
        default_plugin_manager,
        hookimpl,
    )
    from hermes_core.store import SearchHit, SessionStore
    from hermes_core.turns.ledger import SendResult

_LAZY = {
    "GatewayConfig": "hermes_core.config.schema",
    "build_session_context": "hermes_core.gateway.context",
    "build_session_context_prompt": "hermes_core.gateway.context",
    "prefix_sender": "hermes_core.gateway.context",
    "ConfigError": "hermes_core.domain.errors",
    "GatewayLockedError": "hermes_core.domain.errors",
    "HermesError": "hermes_core.domain.errors",
    "InvalidValueError": "hermes_core.domain.errors",
    "MalformedEventError": "hermes_core.domain.errors",
    "MessageNotStoredError": "hermes_core.domain.errors",
    "PlatformConflictError": "hermes_core.domain.errors",
    "PluginConflictError": "hermes_core.domain.errors",
    "PluginError": "hermes_core.domain.errors",
    "RedactionError": "hermes_core.domain.errors",
    "StoreError": "hermes_core.domain.errors",
    "UnknownPlatformError": "hermes_core.domain.errors",
    "read_event": "hermes_core.plugins.events",
    "KeyResolution": "hermes_core.domain.keys",
    "SessionKeyParts": "hermes_core.domain.keys",
    "build_key_from_flags": "hermes_core.domain.keys",
    "build_session_key": "hermes_core.domain.keys",
    "is_shared_multi_user_session": "hermes_core.domain.keys",
    "parse_session_key": "hermes_core.domain.keys",
    "resolve_key": "hermes_core.domain.keys",
    "resolve_key_from_flags": "hermes_core.domain.keys",
    "resolve_session_key": "hermes_core.domain.keys",
    "HomeChannel": "hermes_core.domain.models",
    "MessageEvent": "hermes_core.domain.models",
    "MessageType": "hermes_core.domain.models",
    "SessionContext": "hermes_core.domain.models",
    "SessionEntry": "hermes_core.domain.models",
    "SessionSource": "hermes_core.domain.models",
    "HermesPluginManager": "hermes_core.plugins.manager",
    "PlatformRegistry": "hermes_core.plugins.manager",
    "PluginInfo": "hermes_core.plugins.manager",
    "create_plugin_manager": "hermes_core.plugins.manager",
    "default_plugin_manager": "hermes_core.plugins.manager",
    "hookimpl": "hermes_core.plugins.manager",
    "split_reply": "hermes_core.domain.splitting",
    "utf16_len": "hermes_core.domain.splitting",
    "EvictionCandidate": "hermes_core.domain.specs",
    "ConnectorSpec": "hermes_core.domain.specs",
    "Connector": "hermes_core.domain.connectors",
    "ConnectorContext": "hermes_core.domain.connectors",
    "Inbox": "hermes_core.domain.connectors",
    "WebhookRoute": "hermes_core.domain.connectors",
    "WebRequest": "hermes_core.domain.connectors",
    "WebResponse": "hermes_core.domain.connectors",
    "EvictionPolicy": "hermes_core.domain.specs",
    "LifecycleEvent": "hermes_core.domain.specs",
    "PlatformSpec": "hermes_core.domain.specs",
    "ReadContext": "hermes_core.domain.specs",
    "RecoveryContext": "hermes_core.domain.specs",
    "RecoveryReport": "hermes_core.domain.specs",
    "RecoveryStep": "hermes_core.domain.specs",
    "StoreSpec": "hermes_core.domain.specs",
    "Adapter": "hermes_core.gateway.agents",
    "Agent": "hermes_core.gateway.agents",
    "EchoAgent": "hermes_core.gateway.agents",
    "EditingAdapter": "hermes_core.gateway.agents",
    "Posted": "hermes_core.gateway.agents",
    "TypingAdapter": "hermes_core.gateway.agents",
    "InMemoryAdapter": "hermes_core.gateway.agents",
    "TurnRequest": "hermes_core.gateway.agents",
    "HostCallbacks": "hermes_core.gateway.agents",
    "SendResult": "hermes_core.turns.ledger",
    "Gateway": "hermes_core.gateway.runtime",
    "LoadedAgent": "hermes_core.gateway.agent_loading",
    "agent_options": "hermes_core.gateway.agent_loading",
    "load_agent": "hermes_core.gateway.agent_loading",
    "SearchHit": "hermes_core.store",
    "SessionStore": "hermes_core.store",
}
"""Public names imported on first use (module attribute access)."""


def __getattr__(name: str) -> Any:
    if name == "__version__":
        value: Any = _version()
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module 'hermes_core' has no attribute {name!r}")
    globals()[name] = value
    return value


def _version() -> str | None:
    """The installed distribution's version (None from an uninstalled source tree)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hermes-sessions")
    except PackageNotFoundError:
        return None


__all__ = [
    "Adapter",
    "Agent",
    "ConfigError",
    "Connector",
    "ConnectorContext",
    "ConnectorSpec",
    "EchoAgent",
    "EditingAdapter",
    "EvictionCandidate",
    "EvictionPolicy",
    "Gateway",
    "GatewayConfig",
    "GatewayLockedError",
    "HermesError",
    "HermesPluginManager",
    "HomeChannel",
    "HostCallbacks",
    "InMemoryAdapter",
    "Inbox",
    "InvalidValueError",
    "KeyResolution",
    "LifecycleEvent",
    "LoadedAgent",
    "MalformedEventError",
    "MessageEvent",
    "MessageNotStoredError",
    "MessageType",
    "PlatformConflictError",
    "PlatformRegistry",
    "PlatformSpec",
    "PluginConflictError",
    "PluginError",
    "PluginInfo",
    "Posted",
    "ReadContext",
    "RecoveryContext",
    "RecoveryReport",
    "RecoveryStep",
    "RedactionError",
    "SearchHit",
    "SendResult",
    "SessionContext",
    "SessionEntry",
    "SessionKeyParts",
    "SessionSource",
    "SessionStore",
    "StoreError",
    "StoreSpec",
    "TurnRequest",
    "TypingAdapter",
    "UnknownPlatformError",
    "WebRequest",
    "WebResponse",
    "WebhookRoute",
    "__version__",
    "agent_options",
    "build_key_from_flags",
    "build_session_context",
    "build_session_context_prompt",
    "build_session_key",
    "create_plugin_manager",
    "default_plugin_manager",
    "hookimpl",
    "is_shared_multi_user_session",
    "load_agent",
    "parse_session_key",
    "prefix_sender",
    "read_event",
    "resolve_key",
    "resolve_key_from_flags",
    "resolve_session_key",
    "split_reply",
    "utf16_len",
]
