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
    from hermes_core.agents import (
        Adapter,
        Agent,
        EchoAgent,
        HostCallbacks,
        InMemoryAdapter,
        TurnRequest,
    )
    from hermes_core.config import GatewayConfig
    from hermes_core.context import (
        build_session_context,
        build_session_context_prompt,
        prefix_sender,
    )
    from hermes_core.errors import (
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
    from hermes_core.events import read_event
    from hermes_core.keys import (
        KeyResolution,
        SessionKeyParts,
        build_session_key,
        is_shared_multi_user_session,
        parse_session_key,
        resolve_session_key,
    )
    from hermes_core.ledger import SendResult
    from hermes_core.models import (
        HomeChannel,
        MessageEvent,
        MessageType,
        SessionContext,
        SessionEntry,
        SessionSource,
    )
    from hermes_core.plugins import (
        HermesPluginManager,
        PlatformRegistry,
        PluginInfo,
        create_plugin_manager,
        default_plugin_manager,
        hookimpl,
    )
    from hermes_core.runtime import Gateway
    from hermes_core.specs import (
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
    from hermes_core.store import SearchHit, SessionStore

_LAZY = {
    "GatewayConfig": "hermes_core.config",
    "build_session_context": "hermes_core.context",
    "build_session_context_prompt": "hermes_core.context",
    "prefix_sender": "hermes_core.context",
    "ConfigError": "hermes_core.errors",
    "GatewayLockedError": "hermes_core.errors",
    "HermesError": "hermes_core.errors",
    "InvalidValueError": "hermes_core.errors",
    "MalformedEventError": "hermes_core.errors",
    "MessageNotStoredError": "hermes_core.errors",
    "PlatformConflictError": "hermes_core.errors",
    "PluginConflictError": "hermes_core.errors",
    "PluginError": "hermes_core.errors",
    "RedactionError": "hermes_core.errors",
    "StoreError": "hermes_core.errors",
    "UnknownPlatformError": "hermes_core.errors",
    "read_event": "hermes_core.events",
    "KeyResolution": "hermes_core.keys",
    "SessionKeyParts": "hermes_core.keys",
    "build_session_key": "hermes_core.keys",
    "is_shared_multi_user_session": "hermes_core.keys",
    "parse_session_key": "hermes_core.keys",
    "resolve_session_key": "hermes_core.keys",
    "HomeChannel": "hermes_core.models",
    "MessageEvent": "hermes_core.models",
    "MessageType": "hermes_core.models",
    "SessionContext": "hermes_core.models",
    "SessionEntry": "hermes_core.models",
    "SessionSource": "hermes_core.models",
    "HermesPluginManager": "hermes_core.plugins",
    "PlatformRegistry": "hermes_core.plugins",
    "PluginInfo": "hermes_core.plugins",
    "create_plugin_manager": "hermes_core.plugins",
    "default_plugin_manager": "hermes_core.plugins",
    "hookimpl": "hermes_core.plugins",
    "EvictionCandidate": "hermes_core.specs",
    "EvictionPolicy": "hermes_core.specs",
    "LifecycleEvent": "hermes_core.specs",
    "PlatformSpec": "hermes_core.specs",
    "ReadContext": "hermes_core.specs",
    "RecoveryContext": "hermes_core.specs",
    "RecoveryReport": "hermes_core.specs",
    "RecoveryStep": "hermes_core.specs",
    "StoreSpec": "hermes_core.specs",
    "Adapter": "hermes_core.agents",
    "Agent": "hermes_core.agents",
    "EchoAgent": "hermes_core.agents",
    "InMemoryAdapter": "hermes_core.agents",
    "TurnRequest": "hermes_core.agents",
    "HostCallbacks": "hermes_core.agents",
    "SendResult": "hermes_core.ledger",
    "Gateway": "hermes_core.runtime",
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
    "EchoAgent",
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
    "InvalidValueError",
    "KeyResolution",
    "LifecycleEvent",
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
    "UnknownPlatformError",
    "__version__",
    "build_session_context",
    "build_session_context_prompt",
    "build_session_key",
    "create_plugin_manager",
    "default_plugin_manager",
    "hookimpl",
    "is_shared_multi_user_session",
    "parse_session_key",
    "prefix_sender",
    "read_event",
    "resolve_session_key",
]
