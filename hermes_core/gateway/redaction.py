"""Untrusted-metadata neutralisation and PII pseudonyms.

Names, topics and ids come from the platform and are data, never instructions: the prompt shows
them quoted (a JSON string literal) or, in a sender prefix, inline on one line. Redaction changes
only the text written for the model; routing, keys, storage and adapters keep raw ids.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import stat
import time
from pathlib import Path
from typing import Literal

from hermes_core.domain.errors import RedactionError, StoreError
from hermes_core.domain.text import clean_text
from hermes_core.plugins.records import PlatformRegistry
from hermes_core.state.files import create_private_file, ensure_private_dir

logger = logging.getLogger(__name__)

MAX_VALUE_CHARS = 240
"""Longest neutralised value; longer ones keep their first 237 characters and ``...``."""
USER_PLACEHOLDER = "user_redacted"
"""A user id's stand-in when the HMAC key cannot be used (never the raw id, never a plain hash)."""
CHAT_PLACEHOLDER = "redacted"
"""A chat id's stand-in when the HMAC key cannot be used (``<platform>:redacted`` when prefixed)."""

RedactionMode = Literal["hmac", "sha256"]

_BREAK_TO_SPACE = {0x85: " ", 0x2028: " ", 0x2029: " "}
_BIDI = (*range(0x202A, 0x202F), *range(0x2066, 0x206A))
_ZERO_WIDTH = (0x200B, 0x200C, 0x200D, 0x2060, 0xFEFF)
_INVISIBLE = dict.fromkeys((*_BIDI, *_ZERO_WIDTH))
_CONTROLS = {
    code: " " for code in (*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)) if code not in (0x0A, 0x09)
}
_CLEAN_TABLE = str.maketrans({**_CONTROLS, **_BREAK_TO_SPACE, **_INVISIBLE})
_HIDDEN_RE = re.compile(
    "[\u00ad\u034f\u115f\u1160\u180e\u2061-\u2064\u3164\uffa0\ue000-\uf8ff"
    "\U000e0000-\U000e007f\U000f0000-\U0010ffff]"
)
"""Characters a reader does not see that a model still reads, deleted like the zero-width ones:
soft hyphen, combining grapheme joiner, Hangul fillers, Mongolian vowel separator, invisible
operators, private-use characters and tag characters (U+E0000-E007F, which spell out hidden
ASCII)."""
_WHITESPACE_RE = re.compile(r"\s+")
_KEY_RE = re.compile(rb"[0-9a-f]{64}\n?")
_KEY_FILE_MAX_BYTES = 128
_RACE_WINDOW_SECS = 1.0
_QUOTER = json.JSONEncoder(ensure_ascii=False)
"""What ``json.dumps(value, ensure_ascii=False)`` uses, built once (not on every call)."""


def _clean(value: str) -> str:
    """Line breaks as LF; separators and controls (but LF, TAB) as spaces; bidi, zero-width and
    other invisible characters (:data:`_HIDDEN_RE`) deleted; lone surrogates (unencodable) as
    U+FFFD."""
    text = value.replace("\r\n", "\n").replace("\r", "\n").translate(_CLEAN_TABLE)
    if not text.isascii():
        text = _HIDDEN_RE.sub("", text)
    return clean_text(text)


def _cap(text: str) -> str:
    """At most :data:`MAX_VALUE_CHARS` characters: the first 237 and ``...`` when longer."""
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 3] + "..."


def quote_untrusted(value: str) -> str:
    """The quoted form of untrusted metadata: cleaned, trimmed, capped, then a JSON string literal
    without ASCII escaping, so an injected heading or newline stays inside one quoted value."""
    return _QUOTER.encode(_cap(_clean(value).strip()))


def inline_untrusted(value: str) -> str:
    """The inline form of untrusted metadata (sender prefix): like :func:`quote_untrusted` but on
    one line, whitespace runs collapsed, not quoted; ordinary names come back unchanged."""
    return _cap(_WHITESPACE_RE.sub(" ", _clean(value)).strip())


def one_line(text: str) -> str:
    """``text`` as a single prompt line (for plugin-supplied notes): cleaned, whitespace runs
    collapsed, trimmed, not capped."""
    return _WHITESPACE_RE.sub(" ", _clean(text)).strip()


def sha256_digest(value: str) -> str:
    """First 12 lowercase hex of SHA-256 over UTF-8 ``value`` (the established unkeyed form)."""
    return hashlib.sha256(value.encode("utf-8")).hexdigest()[:12]


def hmac_digest(key: bytes, kind: Literal["user", "chat"], platform: str, value: str) -> str:
    """First 16 lowercase hex of HMAC-SHA-256 with ``key`` over ``kind␟platform␟value``."""
    message = "\x1f".join((kind, platform, value)).encode("utf-8")
    return hmac.new(key, message, hashlib.sha256).hexdigest()[:16]


def _create_key(path: Path) -> bool:
    """Write a fresh secret by exclusive create (0600, fsync file and directory); False when
    the file already exists (another process may have won)."""
    ensure_private_dir(path.parent)
    return create_private_file(path, (secrets.token_bytes(32).hex() + "\n").encode("ascii"))


def _read_key(path: Path) -> bytes:
    """The 32-byte secret in ``path``; ``ValueError``/``OSError`` say why it is unusable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("it is not a regular file")
        if info.st_mode & 0o077:
            raise ValueError(
                f"it is accessible by group or others (mode {stat.S_IMODE(info.st_mode):04o}; "
                "chmod 600 it)"
            )
        raw = os.read(fd, _KEY_FILE_MAX_BYTES + 1)
    finally:
        os.close(fd)
    if not _KEY_RE.fullmatch(raw):
        raise ValueError("it does not hold 64 lowercase hex digits and a newline")
    return bytes.fromhex(raw[:64].decode("ascii"))


def _being_written(path: Path) -> bool:
    """Whether ``path`` looks like another process's key between its create and its write."""
    info = path.lstat()
    return info.st_size < 64 and time.time() - info.st_mtime < _RACE_WINDOW_SECS


def load_hmac_key(path: Path) -> bytes | None:
    """The install secret in ``path``, created on first use; None when it is unusable
    (not creatable, unreadable, non-regular, a symlink, malformed, or accessible by group or
    others), after logging an error that names the file but never its content."""
    try:
        if _create_key(path):
            logger.info("created the PII pseudonym key %s", path)
        deadline = time.monotonic() + _RACE_WINDOW_SECS
        while True:
            try:
                return _read_key(path)
            except ValueError:
                if time.monotonic() > deadline or not _being_written(path):
                    raise
                time.sleep(0.02)
    except (OSError, ValueError, StoreError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        logger.error(
            "PII pseudonym key %s is unusable (%s): ids in the prompt are shown as placeholders "
            "until it is fixed or deleted (deleting it makes a new key and new pseudonyms)",
            path, reason,
        )  # fmt: skip
    return None


class Redactor:
    """How ids appear in text written for the model: raw, or pseudonymised when redaction is on
    and the id belongs to a PII-safe platform.

    One instance serves one prompt (or one sender prefix): the HMAC key is read at most once, on
    the first pseudonym. Hooks consulted for redaction (the platform lookup for ``pii_safe`` and
    the participant canonicaliser) fail closed with :class:`RedactionError` naming the plugin.
    """

    def __init__(
        self, registry: PlatformRegistry, *, enabled: bool, mode: RedactionMode, key_file: Path
    ) -> None:
        self._registry = registry
        self._enabled = enabled
        self._mode = mode
        self._key_file = key_file
        self._key: bytes | None = None
        self._key_loaded = False

    def _fail(self, platform: str, what: str, exc: Exception) -> RedactionError:
        """The fail-closed error; the hook's own message stays in the chained cause (it may carry
        the raw id being redacted)."""
        plugin = self._registry.owners.get(platform)
        who = f"platform plugin {plugin!r}" if plugin else "no plugin registers it"
        return RedactionError(
            plugin,
            platform,
            f"cannot redact the prompt: {what} for platform {platform!r} raised "
            f"{type(exc).__name__} ({who}); no prompt was produced. Fix or disable that plugin, or "
            "turn privacy.redact_pii off.",
        )

    def applies(self, platform: str) -> bool:
        """Whether ids of ``platform`` are pseudonymised: redaction is on and it is PII-safe."""
        if not self._enabled:
            return False
        try:
            return self._registry.require(platform).pii_safe is True
        except Exception as exc:  # fail closed, naming the plugin
            raise self._fail(platform, "the pii_safe lookup", exc) from exc

    def _hmac(self, kind: Literal["user", "chat"], platform: str, value: str) -> str | None:
        """The keyed digest of a canonicalised id, or None when the key is unusable."""
        if not self._key_loaded:
            self._key, self._key_loaded = load_hmac_key(self._key_file), True
        if self._key is None:
            return None
        canonicalise = self._registry.require(platform).canonical_participant
        if canonicalise is not None:
            try:
                value = canonicalise(value) or value
            except Exception as exc:  # fail closed, naming the plugin
                raise self._fail(platform, "the participant canonicaliser", exc) from exc
        return hmac_digest(self._key, kind, platform, value)

    def _digest(self, kind: Literal["user", "chat"], platform: str, value: str) -> str | None:
        if self._mode == "sha256":
            return sha256_digest(value)
        return self._hmac(kind, platform, value)

    def user_id(self, platform: str, value: str) -> str:
        """A sender id as shown: raw, or ``user_<h>`` (``user_redacted`` without a usable key)."""
        if not value or not self.applies(platform):
            return value
        digest = self._digest("user", platform, value)
        return USER_PLACEHOLDER if digest is None else f"user_{digest}"

    def chat_id(self, platform: str, value: str) -> str:
        """A chat id of ``platform`` as shown: raw, ``<p>:<h(rest)>`` when it starts with a
        registered platform name ``p``, else ``<h(id)>`` (placeholders without a usable key)."""
        if not value or not self.applies(platform):
            return value
        prefix, sep, rest = value.partition(":")
        if sep and prefix in self._registry:
            return self._prefixed(prefix, rest)
        digest = self._digest("chat", platform, value)
        return CHAT_PLACEHOLDER if digest is None else digest

    def home_channel_id(self, platform: str, value: str) -> str:
        """A home channel's id as shown: raw, or ``<platform>:<h(id)>``."""
        if not value or not self.applies(platform):
            return value
        return self._prefixed(platform, value)

    def _prefixed(self, platform: str, value: str) -> str:
        digest = self._digest("chat", platform, value)
        return f"{platform}:{CHAT_PLACEHOLDER if digest is None else digest}"
