"""Recent: the bounded map in order of use behind the entry, prompt and seen-message caches."""

from __future__ import annotations

from hermes_core.domain.recent import Recent


def test_put_drops_the_least_recently_used_keys_beyond_the_size() -> None:
    recent: Recent[str, int] = Recent(2)
    assert recent.put("a", 1) == []
    assert recent.put("b", 2) == []
    assert recent.use("a") == 1  # b is now the least recently used
    assert recent.put("c", 3) == ["b"]
    assert list(recent) == ["a", "c"]


def test_putting_a_present_key_replaces_its_value_and_drops_nothing() -> None:
    recent: Recent[str, int] = Recent(2)
    recent.put("a", 1)
    recent.put("b", 2)
    assert recent.put("a", 10) == []
    assert list(recent.items()) == [("b", 2), ("a", 10)]


def test_use_of_an_absent_key_is_none_and_changes_nothing() -> None:
    recent: Recent[str, int] = Recent(3)
    recent.put("a", 1)
    assert recent.use("z") is None
    assert list(recent) == ["a"]
