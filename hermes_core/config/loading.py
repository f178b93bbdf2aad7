"""Reading a configuration file: YAML's safe loader made strict, and every problem with the file
(unreadable, not YAML, a duplicate key, too deep) as a
:class:`~hermes_core.domain.errors.ConfigError` that gives the line and column but never quotes the
file's text (it may hold a credential).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml

from hermes_core.domain.errors import ConfigError
from hermes_core.state.files import read_user_file

__all__ = ["HugeInteger", "dotted", "read_yaml"]

_MAX_DEPTH = 32  # nesting levels a configuration file may use
MAX_CONFIG_BYTES = 1 << 20
"""A configuration file may hold at most this many bytes (1 MiB): it is read whole."""
_MAX_DIGITS = 100  # longer YAML integers are not converted (Python refuses more than 4300 digits)


def dotted(loc: Iterable[int | str]) -> str:
    """``gateway.reset_triggers[0]`` from its parts; empty parts (the document) are skipped."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc if p != "").lstrip(".")


class HugeInteger:
    """Stands in for a YAML integer too long to convert; validation then rejects it like any
    out-of-range number, naming the key and its range (a host's key stays ignored)."""

    def __repr__(self) -> str:
        return f"<an integer of {_MAX_DIGITS}+ digits>"


class _LoadProblem(yaml.MarkedYAMLError):
    """A file :class:`_ConfigLoader` refuses; ``key`` is the dotted key concerned."""

    def __init__(self, key: str, problem: str, mark: yaml.Mark | None) -> None:
        super().__init__(problem=problem, problem_mark=mark)
        self.key = key


class _ConfigLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing duplicate keys (YAML keeps the last one silently) and nesting
    deeper than ``_MAX_DEPTH`` (composing recurses), and not converting integers longer than
    ``_MAX_DIGITS`` (Python refuses them with a bare ``ValueError``)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._path: list[int | str] = []  # where the node being composed sits

    def compose_node(
        self, parent: yaml.Node | None, index: int | yaml.Node | None
    ) -> yaml.Node | None:
        """Compose one node; ``index`` is a value's key node, an item's position or None."""
        if len(self._path) > _MAX_DEPTH:
            problem = f"nested more than {_MAX_DEPTH} levels deep; flatten this value"
            mark = parent.start_mark if parent is not None else None
            raise _LoadProblem(dotted(self._path), problem, mark)
        if isinstance(index, int):
            self._path.append(index)
        else:
            self._path.append(str(index.value) if isinstance(index, yaml.ScalarNode) else "")
        try:
            return super().compose_node(parent, index)  # type: ignore[arg-type]  # stub: int
        finally:
            self._path.pop()

    def compose_mapping_node(self, anchor: Any) -> yaml.MappingNode:
        """Compose a mapping, refusing a key that appears in it twice."""
        node = super().compose_mapping_node(anchor)
        first: dict[tuple[str, object], yaml.Mark] = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue
            seen = first.setdefault((key.tag, key.value), key.start_mark)
            if seen is not key.start_mark:
                name = dotted((*self._path, str(key.value)))
                problem = f"duplicate key {name} (first on line {seen.line + 1}); keep only one"
                raise _LoadProblem(name, problem, key.start_mark)
        return node

    def construct_yaml_int(self, node: yaml.ScalarNode) -> Any:
        """An int, or a :class:`HugeInteger` when the literal is too long to convert."""
        if len(str(node.value)) > _MAX_DIGITS:
            return HugeInteger()
        return super().construct_yaml_int(node)


_ConfigLoader.add_constructor("tag:yaml.org,2002:int", _ConfigLoader.construct_yaml_int)


def read_yaml(name: str) -> Any:
    """The document in the file ``name`` (None when it is empty); errors name the file. A
    directory, FIFO or device, or a file over :data:`MAX_CONFIG_BYTES`, is refused unread."""
    try:
        text = read_user_file(name, MAX_CONFIG_BYTES).decode("utf-8")
    except FileNotFoundError:
        raise ConfigError("", f"{name}: configuration file not found", source=name) from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ConfigError(
            "", f"{name}: cannot read the file: {reason}; name a YAML configuration file.",
            source=name,
        ) from exc  # fmt: skip
    loader = _ConfigLoader(text)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, name) from None  # PyYAML's message quotes the file's text
    finally:
        loader.dispose()


def _yaml_error(exc: yaml.YAMLError, name: str) -> ConfigError:
    """A YAML problem with its line and column, without the quoted text PyYAML adds."""
    if not isinstance(exc, yaml.MarkedYAMLError):
        return ConfigError("", f"{name}: not valid YAML: {exc}", source=name)
    mark = exc.problem_mark or exc.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    if isinstance(exc, _LoadProblem):
        return ConfigError(exc.key, f"{name}: {where}{exc.problem}", source=name)
    what = ", ".join(filter(None, (exc.context, exc.problem)))
    return ConfigError("", f"{name}: {where}not valid YAML: {what}", source=name)
