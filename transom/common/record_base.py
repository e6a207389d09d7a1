"""The machinery of the typed records: `Record.to_dict` / `Record.from_dict` and `RecordError`.

`from_dict` validates a value that crossed a process boundary against the dataclass's type
hints (str, int, float, bool, lists, dicts, unions with None, str enums, nested records),
ignores keys it does not know and raises `RecordError` on a missing field or a wrong type. A
list or dict field declared with `metadata=DROP_INVALID` keeps its valid items and leaves out the
others (what one process reported about many things: one bad entry must not cost the rest). The
records themselves are in transom.common.records. This module must never do I/O.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from enum import Enum
from typing import Any, TypeVar

R = TypeVar("R", bound="Record")

# The `dataclasses.field` metadata of a list field whose invalid items `from_dict` leaves out.
DROP_INVALID = {"drop_invalid": True}


class RecordError(ValueError):
    """A stored value that is not a valid record: what was wrong, and where."""


class Record:
    """Base of the records: `to_dict` for JSON, `from_dict` that validates."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
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
        fields, known, has_extra = _schema(cls)
        values: dict[str, Any] = {}
        for name, parse, where, required in fields:
            if name in data:
                values[name] = parse(data[name], where)
            elif required:
                raise RecordError(f"{cls.__name__}: missing field {name!r}")
        if has_extra:
            values["extra"] = {k: v for k, v in data.items() if k not in known}
        return cls(**values)


# A function that checks a value against one type hint and converts it: (value, where) -> value.
Parser = Callable[[Any, str], Any]
# A record class's fields but `extra`, in order: (name, parser, where in errors, required).
Schema = tuple[list[tuple[str, Parser, str, bool]], frozenset[str], bool]
_SCHEMAS: dict[type, Schema] = {}


def _schema(cls: type) -> Schema:
    """A record class's fields with their parsers, the names of all its fields, and whether it
    keeps unknown keys in `extra`: worked out once per class (a controller parses a thousand
    nodes' summaries a second; get_type_hints and the hints' introspection were most of it)."""
    found = _SCHEMAS.get(cls)
    if found is None:
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)
        parsers = [
            (
                f.name,
                _valid_items(hints[f.name])
                if f.metadata.get("drop_invalid")
                else _parser(hints[f.name]),
                f"{cls.__name__}.{f.name}",
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            )
            for f in fields
            if f.name != "extra"
        ]
        names = frozenset(f.name for f in fields)
        found = _SCHEMAS[cls] = (parsers, names, "extra" in names)
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


@functools.cache
def _parser(hint: Any) -> Parser:
    """The parser of `hint`: it returns the value checked against (and converted to) the type,
    or raises RecordError saying where it is not. Items of a list or a dict are checked without
    naming their place; the place is worked out only for an item that fails."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        nullable = type(None) in typing.get_args(hint)
        options = [_parser(o) for o in typing.get_args(hint) if o is not type(None)]

        def parse_union(value: Any, where: str) -> Any:
            if value is None and nullable:
                return None
            errors = []
            for option in options:
                try:
                    return option(value, where)
                except RecordError as e:
                    errors.append(str(e))
            raise RecordError("; ".join(errors))

        return parse_union
    if hint is Any:
        return _as_is
    if origin is list or hint is list:
        (item_hint,) = typing.get_args(hint) or (Any,)
        item = _parser(item_hint)

        def parse_list(value: Any, where: str) -> Any:
            if not isinstance(value, list):
                raise RecordError(f"{where}: expected a list, got {type(value).__name__}")
            try:
                return [item(v, where) for v in value]
            except RecordError:  # again, naming each item's place, to say which failed
                return [item(v, f"{where}[{i}]") for i, v in enumerate(value)]

        return parse_list
    if origin is dict or hint is dict:
        _, value_hint = typing.get_args(hint) or (Any, Any)
        entry = _parser(value_hint)

        def parse_dict(value: Any, where: str) -> Any:
            if not isinstance(value, dict):
                raise RecordError(f"{where}: expected an object, got {type(value).__name__}")
            try:
                return {k: entry(v, where) for k, v in value.items()}
            except RecordError:  # again, naming each entry's place, to say which failed
                return {k: entry(v, f"{where}[{k!r}]") for k, v in value.items()}

        return parse_dict
    if isinstance(hint, type) and issubclass(hint, Enum):
        enum = hint

        def parse_enum(value: Any, where: str) -> Any:
            try:
                return enum(value)
            except ValueError:
                raise RecordError(f"{where}: {value!r} is not a {enum.__name__}") from None

        return parse_enum
    if isinstance(hint, type) and issubclass(hint, Record):
        record = hint

        def parse_record(value: Any, where: str) -> Any:
            try:
                return record.from_dict(value)
            except RecordError as e:
                raise RecordError(f"{where}: {e}") from None

        return parse_record
    if hint is float:
        return _float
    if hint is int:
        return _int
    if isinstance(hint, type):
        kind = hint

        def parse_instance(value: Any, where: str) -> Any:
            if isinstance(value, kind):
                return value
            raise _wrong(value, kind, where)

        return parse_instance

    def parse_nothing(value: Any, where: str) -> Any:
        raise _wrong(value, hint, where)

    return parse_nothing


def _valid_items(hint: Any) -> Parser:
    """The parser of a list or dict field declared DROP_INVALID: the value must be a list (an
    object); its items (entries) that are not valid are left out."""
    origin = typing.get_origin(hint)
    if origin is dict:
        item = _parser(typing.get_args(hint)[1])

        def parse_valid_entries(value: Any, where: str) -> dict[str, Any]:
            if not isinstance(value, dict):
                raise RecordError(f"{where}: expected an object, got {type(value).__name__}")
            valid = {}
            for k, v in value.items():
                try:
                    valid[k] = item(v, where)
                except RecordError:
                    continue
            return valid

        return parse_valid_entries
    if origin is not list:
        raise TypeError(f"DROP_INVALID is for list and dict fields, not {hint}")
    (item_hint,) = typing.get_args(hint)
    item = _parser(item_hint)

    def parse_valid_items(value: Any, where: str) -> list[Any]:
        if not isinstance(value, list):
            raise RecordError(f"{where}: expected a list, got {type(value).__name__}")
        valid = []
        for v in value:
            try:
                valid.append(item(v, where))
            except RecordError:
                continue
        return valid

    return parse_valid_items


def _as_is(value: Any, where: str) -> Any:
    return value


def _float(value: Any, where: str) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise _wrong(value, float, where)


def _int(value: Any, where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise _wrong(value, int, where)


def _wrong(value: Any, hint: Any, where: str) -> RecordError:
    return RecordError(f"{where}: expected {getattr(hint, '__name__', hint)}, got {value!r:.80}")


def parse_all(cls: type[R], values: dict[str, Any]) -> dict[str, R]:
    """Parse every value of a prefix read; a value that is not a valid record is left out."""
    out = {}
    for name, value in values.items():
        try:
            out[name] = cls.from_dict(value)
        except RecordError:
            continue
    return out
