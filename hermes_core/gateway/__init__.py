"""The :class:`~hermes_core.gateway.runtime.Gateway` and its parts: inbound messages, the lanes
that run turns, the commands, delivery, lane ownership in a shared store, the agent cache with
its memory budget and eviction, the session context with redaction, and housekeeping."""
