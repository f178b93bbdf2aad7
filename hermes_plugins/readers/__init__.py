"""Readers of the built-in platforms' own event payloads (``PlatformSpec.read_event``).

Each module reads one platform's documented payload shape with :class:`fields.Fields`, which
names the dotted path of any field that is missing or of the wrong type in the
:class:`~hermes_core.domain.errors.MalformedEventError` it raises. No platform SDK is needed.
"""
