"""Shared WhatsApp content as short, stable text: a location as ``name, address (latitude,
longitude)``, a contact card as ``name: phone, phone`` (the original bridge also hands the agent
such content as text)."""

from __future__ import annotations

from hermes_plugins.readers.fields import Fields, malformed


def place_text(place: Fields, latitude: str, longitude: str) -> str:
    """``name, address (latitude, longitude)``, leaving out what the location lacks."""
    words = ", ".join(part for part in (place.text("name"), place.text("address")) if part)
    degrees = [number_text(place, latitude), number_text(place, longitude)]
    if None not in degrees:
        words = f"{words} ({degrees[0]}, {degrees[1]})".strip()
    return words


def number_text(place: Fields, name: str) -> str | None:
    """The number ``name`` as written (None when absent)."""
    value = place.data.get(name)
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise malformed(f"{place.path}.{name}", "must be a number")


def card_text(name: str | None, phones: list[str | None]) -> str:
    """``name: phone, phone`` of one shared contact."""
    numbers = ", ".join(phone for phone in phones if phone)
    if not numbers:
        return name or ""
    return f"{name}: {numbers}" if name else numbers


def vcard_phones(card: Fields) -> list[str | None]:
    """The numbers of a vCard's ``TEL`` lines (``item1.TEL;waid=...:+1 940 555 1234``)."""
    phones: list[str | None] = []
    for line in (card.text("vcard") or "").splitlines():
        name, _, value = line.partition(":")
        if name.split(";")[0].rpartition(".")[2].upper() == "TEL":
            phones.append(value.strip())
    return phones
