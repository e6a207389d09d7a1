"""The machinery of the typed records: `Record.to_dict` / `Record.from_dict` and `RecordError`.

`from_dict` validates a value that crossed a process boundary against the dataclass's type
hints (str, int, float, bool, lists, dicts, unions with None, str enums, nested records),
ignores keys it does not know and raises `RecordError` on a missing field or a wrong type. The
records themselves are in transom.common.records. This module must never do I/O.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from enum import Enum
from typing import Any, TypeVar

R = TypeVar("R", bound="Record")


class RecordError(ValueError):
    """A stored value that is not a valid record: what was wrong, and where."""


class Record:
    """Base of the records: `to_dict` for JSON, `from_dict` that validates."""

    def to_dict(self) -> dict:
        out: dict = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.name == "extra":
                out.update({k: _plain(v) for k, v in value.items() if k not in out})
                continue
            out[f.name] = _plain(value)
        return out

    @classmethod
    def from_dict(cls: type[R], data: Any) -> R:
        if not isinstance(data, dict):
            raise RecordError(f"{cls.__name__}: expected an object, got {type(data).__name__}")
        hints, known = _schema(cls)
        values: dict = {}
        for name, f in known.items():
            if name == "extra":
                continue
            if name not in data:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise RecordError(f"{cls.__name__}: missing field {name!r}")
                continue
            values[name] = _parse(data[name], hints[name], f"{cls.__name__}.{name}")
        if "extra" in known:
            values["extra"] = {k: v for k, v in data.items() if k not in known}
        return cls(**values)


_SCHEMAS: dict[type, tuple[dict[str, Any], dict[str, dataclasses.Field]]] = {}


def _schema(cls: type) -> tuple[dict[str, Any], dict[str, dataclasses.Field]]:
    """A record class's type hints and fields, worked out once (get_type_hints evaluates every
    annotation string on each call: a controller parsing a thousand nodes' summaries a second
    spent most of its parsing there)."""
    found = _SCHEMAS.get(cls)
    if found is None:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        found = _SCHEMAS[cls] = (typing.get_type_hints(cls), fields)
    return found


def _plain(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _parse(value: Any, hint: Any, where: str) -> Any:
    """`value` checked against (and converted to) the type `hint`; RecordError if it is not."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _parse(value, option, where)
            except RecordError as e:
                errors.append(str(e))
        raise RecordError("; ".join(errors))
    if hint is Any:
        return value
    if origin is list or hint is list:
        if not isinstance(value, list):
            raise RecordError(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(hint) or (Any,)
        return [_parse(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise RecordError(f"{where}: expected an object, got {type(value).__name__}")
        _, item = typing.get_args(hint) or (Any, Any)
        return {k: _parse(v, item, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(hint, type) and issubclass(hint, Enum):
        try:
            return hint(value)
        except ValueError:
            raise RecordError(f"{where}: {value!r} is not a {hint.__name__}") from None
    if isinstance(hint, type) and issubclass(hint, Record):
        try:
            return hint.from_dict(value)
        except RecordError as e:
            raise RecordError(f"{where}: {e}") from None
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(hint, type) and isinstance(value, hint):
        return value
    raise RecordError(f"{where}: expected {getattr(hint, '__name__', hint)}, got {value!r:.80}")


def parse_all(cls: type[R], values: dict[str, Any]) -> dict[str, R]:
    """Parse every value of a prefix read; a value that is not a valid record is left out."""
    out = {}
    for name, value in values.items():
        try:
            out[name] = cls.from_dict(value)
        except RecordError:
            continue
    return out
