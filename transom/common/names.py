"""Ids and names: the one pattern job and node ids must match, and the order nodes are listed in.

Ids cross process boundaries (command lines, etcd keys, directory names, socket paths), so
every entry point validates them with `check_id`. This module must never do I/O.
"""

from __future__ import annotations

import functools
import re

ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
ID_RULE = "letters, digits, '.', '_' and '-', starting with a letter or digit, at most 64"


class BadId(ValueError):
    """An id that does not match `ID_PATTERN`; the message names what was wrong."""


def check_id(what: str, value: str) -> str:
    """`value` if it is a valid id, else BadId naming `what` (e.g. '--job-id')."""
    if not isinstance(value, str) or not ID_PATTERN.fullmatch(value):
        raise BadId(f"{what} {value!r}: use {ID_RULE}")
    return value


def valid_id(value: object) -> bool:
    """Whether `value` is a valid id (a value read from a file or a message: no error to raise)."""
    return isinstance(value, str) and ID_PATTERN.fullmatch(value) is not None


@functools.lru_cache(maxsize=1 << 16)
def natural_key(name: str) -> tuple[int | str, ...]:
    """Sort key for names with numbers: node2 < node10 (cached: the controller sorts a thousand
    node names several times a tick)."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def listing(names: list[str], most: int = 8) -> str:
    """`names` for a message: all of them when there are at most `most`, else the first few and
    how many more (a thousand-node job's log lines and events stay short); "" for none."""
    if len(names) <= most:
        return ", ".join(names)
    return f"{', '.join(names[: most - 1])} and {len(names) - most + 1} more"
