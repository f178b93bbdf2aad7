"""hermes-sessions: session lifecycle for chat-agent gateways.

The public API is :data:`__all__`; plugins implement hooks with :data:`hookimpl`. The names a
host needs to run a gateway (``Gateway``, ``SessionStore``, ``Agent``, ``SendResult``, ...) are
imported on first use, so a platform plugin importing ``hermes_core`` does not load the runtime.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from hermes_core.agents import (
        Adapter,
        Agent,
        EchoAgent,
        HostCallbacks,
        InMemoryAdapter,
        TurnRequest,
    )
    from hermes_core.ledger import SendResult
    from hermes_core.runtime import Gateway
    from hermes_core.store import SearchHit, SessionStore

_LAZY = {
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
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hermes_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


try:
    __version__: str | None = version("hermes-sessions")
except PackageNotFoundError:  # running from an uninstalled source tree
    __version__ = None

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
