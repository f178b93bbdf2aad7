"""Shared WhatsApp content as short, stable text: a location as ``name, address (latitude,
longitude)``, a contact card as ``name: phone, phone``, a WhatsApp Web button, list or template
reply as what it chose (the original bridge also hands the agent such content as text)."""

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


def web_choice(message: Fields) -> tuple[Fields, str, str | None] | None:
    """A WhatsApp Web reply to buttons, a list, a template's buttons or a native flow: (the reply
    part, its text, the id of what it chose); None for other content. The text is what the user
    saw (``selectedDisplayText``, the list row's ``title``), a flow's submitted ``paramsJson``
    else its ``body.text``, as the Cloud API reader reads the same replies."""
    part = message.opt_obj("buttonsResponseMessage")
    if part is not None:
        return part, part.text("selectedDisplayText") or "", part.opt_id("selectedButtonId")
    part = message.opt_obj("templateButtonReplyMessage")
    if part is not None:
        return part, part.text("selectedDisplayText") or "", part.opt_id("selectedId")
    part = message.opt_obj("listResponseMessage")
    if part is not None:
        row = part.opt_obj("singleSelectReply")
        return part, part.text("title") or "", row.opt_id("selectedRowId") if row else None
    part = message.opt_obj("interactiveResponseMessage")
    if part is not None:
        flow = part.opt_obj("nativeFlowResponseMessage")
        body = part.opt_obj("body")
        said = (flow.text("paramsJson") if flow else None) or (body.text("text") if body else None)
        return part, said or "", flow.text("name") if flow else None
    return None


def vcard_phones(card: Fields) -> list[str | None]:
    """The numbers of a vCard's ``TEL`` lines (``item1.TEL;waid=...:+1 940 555 1234``)."""
    phones: list[str | None] = []
    for line in (card.text("vcard") or "").splitlines():
        name, _, value = line.partition(":")
        if name.split(";")[0].rpartition(".")[2].upper() == "TEL":
            phones.append(value.strip())
    return phones
