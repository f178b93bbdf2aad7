"""hermes-sessions: session lifecycle for chat-agent gateways.

The public API is :data:`__all__`; plugins implement hooks with :data:`hookimpl`.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from hermes_core.agents import Adapter, Agent, EchoAgent, InMemoryAdapter, TurnRequest
from hermes_core.config import GatewayConfig
from hermes_core.context import (
    build_session_context,
    build_session_context_prompt,
    prefix_sender,
)
from hermes_core.errors import (
    ConfigError,
    HermesError,
    InvalidValueError,
    PlatformConflictError,
    PluginConflictError,
    PluginError,
    RedactionError,
    UnknownPlatformError,
)
from hermes_core.gateway_texts import HostCallbacks
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
from hermes_core.runtime import Gateway
from hermes_core.specs import (
    EvictionCandidate,
    EvictionPolicy,
    LifecycleEvent,
    PlatformSpec,
    RecoveryContext,
    RecoveryReport,
    RecoveryStep,
    StoreSpec,
)
from hermes_core.store import SessionStore

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
    "HermesError",
    "HermesPluginManager",
    "HomeChannel",
    "HostCallbacks",
    "InMemoryAdapter",
    "InvalidValueError",
    "KeyResolution",
    "LifecycleEvent",
    "MessageEvent",
    "MessageType",
    "PlatformConflictError",
    "PlatformRegistry",
    "PlatformSpec",
    "PluginConflictError",
    "PluginError",
    "PluginInfo",
    "RecoveryContext",
    "RecoveryReport",
    "RecoveryStep",
    "RedactionError",
    "SessionContext",
    "SessionEntry",
    "SessionKeyParts",
    "SessionSource",
    "SessionStore",
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
    "resolve_session_key",
]
