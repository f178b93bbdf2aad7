"""Named errors of hermes-sessions.

Every error a caller can cause is a :class:`HermesError`; errors about a bad value also subclass
:class:`ValueError` so generic callers can catch them, and carry the offending field.
"""

from __future__ import annotations

SHOWN_CHARS = 80
"""How much of an offending value an error message repeats."""


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` for an error message, cut to about ``limit`` characters with the full
    length said: a 2 MB id must not make a 2 MB error. Every message quoting a value a caller
    gave uses it."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f" ({len(value)} characters)" if isinstance(value, str | bytes) else ""
    return f"{text[: limit - 3]}...{size}"


class HermesError(Exception):
    """Base class of every error raised by hermes-sessions."""


class InvalidValueError(HermesError, ValueError):
    """A value supplied by a caller, a file or a platform is not acceptable.

    ``field`` names the offending field (dotted for nested data); the message says what to change.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class UnknownPlatformError(InvalidValueError):
    """A platform name that no loaded plugin registers."""


class MalformedEventError(InvalidValueError):
    """A raw platform payload cannot be read into an event: it is not the shape the platform
    documents, or it lacks what only the host can add (e.g. a Discord thread's parent).

    ``field`` is the dotted path of the offending field in the payload (``payload`` for the whole).
    """


class ConfigError(InvalidValueError):
    """A configuration key holds a value that is not accepted; names the key and the file."""

    def __init__(self, key: str, message: str, *, source: str | None = None) -> None:
        super().__init__(key, message)
        self.key = key
        self.source = source


class PluginError(HermesError):
    """A plugin could not be loaded, registered or validated."""


class PluginConflictError(PluginError):
    """Two plugins claim one name (a platform, a storage scheme, a recovery step) or two plugins
    each replace the built-in eviction policy; the message names both and which to disable."""


class PlatformConflictError(PluginConflictError):
    """Two plugins registered the same platform name."""


class StoreContractError(PluginError):
    """A storage backend lacks a method of the required contract or of a capability its
    ``StoreSpec`` declares; the message names the plugin and the methods."""


class GatewayLockedError(HermesError):
    """Another process holds the lock this one needs: a gateway's state directory, or the one
    writer's lock on a database. The message names the holder where it is known.

    ``situation`` is the message without its advice (who holds what), for a caller such as the
    command line that gives its own advice; it is the whole message when none was given.
    """

    def __init__(self, message: str, *, situation: str | None = None) -> None:
        super().__init__(message)
        self.situation = situation or message


class StoreError(HermesError):
    """A storage operation failed; the message says what to do (never a raw driver error)."""


class StoreUnavailableError(StoreError):
    """The configured store cannot be opened or reached."""


class SchemaVersionError(StoreError):
    """The database was written by a newer hermes-sessions than this one."""


class KeySchemaError(StoreError):
    """The store's session keys follow another schema than ``keys.schema`` (or a re-key was
    interrupted); the message says how to re-key."""


class CorruptDatabaseError(StoreError):
    """The canonical database is corrupt; ``hermes-sessions doctor`` explains the repair."""


class ReadOnlyStoreError(HermesError):
    """A change was asked of a store opened read-only; nothing was written."""


class DuplicateSessionIdError(StoreError):
    """A freshly drawn session id already exists (the store draws another)."""


class TranscriptWriteError(StoreError):
    """A transcript message could not be stored; nothing was acknowledged."""


class MessageNotStoredError(HermesError):
    """``Gateway.handle_message`` could not store an inbound message: leave the platform's
    message unacknowledged so that the platform delivers it again (the sender was told)."""


class MessageRedeliveredError(HermesError):
    """The platform delivered a message the lane has already stored; it is not stored again."""


class LeaseLostError(StoreError):
    """A turn's lane lease expired and another process holds the lane now: nothing more of the
    turn is written (the new holder resumes it). Keep ``storage.turn_lease_secs`` well above
    the longest pause the process can have (it is renewed every quarter of it)."""


class RoutingConflictError(StoreError):
    """On a store shared by several gateway processes, another process changed a lane's
    routing entry between this one's read and its write, on every attempt: nothing was
    written and the stale cached copy was dropped. Try again: the change then applies to the
    entry as it is now."""


class TranscriptReadError(StoreError):
    """A stored transcript could not be read (never reported as an empty transcript)."""


class TurnInProgressError(StoreError):
    """The transcript cannot be rewritten while a turn marker is set on its lane."""


class RedactionError(HermesError):
    """A hook consulted for PII redaction raised, so no prompt was produced (fail closed).

    ``plugin`` names the plugin that owns ``platform`` (None when no plugin registers it).
    """

    def __init__(self, plugin: str | None, platform: str, message: str) -> None:
        super().__init__(message)
        self.plugin = plugin
        self.platform = platform
