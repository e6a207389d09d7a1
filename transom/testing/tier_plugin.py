"""The test tiers, a pytest plugin (pyproject.toml loads it: `-p transom.testing.tier_plugin`).

Every test gets exactly one of three markers (docs/testing.md):
- `unit`: no processes (no etcd, no `transom`, no workers); fails loudly if it starts one;
- `integration`: a real etcd or real processes, seconds each;
- `e2e`: whole jobs (the tests once marked `slow`, which still means e2e).
A test's tier is the one tier marker on it (the test's own, its class's or its module's
`pytestmark`; two different ones are an error); without one it is what the fixtures it uses
start (FIXTURE_TIERS: `e2e` for a whole `transom run` job, `integration` for a real etcd), else
`unit`. So a new test file needs no central list: a unit test that starts a process fails and
says to mark it `integration`.
It applies to every test directory (tests/, benchmarks/tests/) whatever conftest they have.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _pytest.monkeypatch import MonkeyPatch

TIERS = ("unit", "integration", "e2e")
# Markers of the tests written before the tiers, and the tier each means.
TIER_ALIASES = {"slow": "e2e"}
# Fixtures (tests/conftest.py's) that start a whole job, a real etcd: the tier of a test that
# uses one and names no tier (the highest, if it uses several).
FIXTURE_TIERS = {"start_job": "e2e", "etcd": "integration", "store": "integration"}
TIER_KEY = pytest.StashKey[str]()


def tier_of(item: pytest.Item) -> str:
    """The tier of `item`: the one tier marked on it (on the test, its class or its module's
    `pytestmark`), else what its fixtures say. Two different tiers on one test are an error:
    `-m` would select it in both."""
    named = {TIER_ALIASES.get(m.name, m.name) for m in item.iter_markers()} & set(TIERS)
    if len(named) > 1:
        raise pytest.UsageError(
            f"{item.nodeid} is marked {' and '.join(sorted(named))}: a test has one tier "
            "(docs/testing.md)"
        )
    if named:
        return named.pop()
    fixtures = getattr(item, "fixturenames", ())
    implied = {FIXTURE_TIERS[f] for f in fixtures if f in FIXTURE_TIERS}
    return max(implied | {"unit"}, key=TIERS.index)


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: the tiers must be there to select on
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = tier_of(item)
        item.stash[TIER_KEY] = tier
        if item.get_closest_marker(tier) is None:  # no tier marked: add it, `-m` selects on it
            item.add_marker(tier)


class ProcessStarted(Exception):
    """A unit test started a process."""


@pytest.fixture(autouse=True)
def unit_tests_start_no_process(request: pytest.FixtureRequest) -> Iterator[None]:
    """A `unit` test that starts a process (subprocess, fork) fails, naming the fix: a unit
    test must run without any, or be marked `integration` (or `e2e`)."""
    if request.node.stash.get(TIER_KEY, "unit") != "unit":
        yield
        return
    started: list[str] = []

    def refuse(what: str) -> Callable[..., Any]:
        def refused(*args: Any, **kwargs: Any) -> Any:
            started.append(what)
            raise ProcessStarted(
                f"a unit test started a process ({what}): mark the test or its module "
                "`integration` (pytestmark = pytest.mark.integration), see docs/testing.md"
            )

        return refused

    patch = MonkeyPatch()
    patch.setattr(subprocess.Popen, "_execute_child", refuse("subprocess"))
    patch.setattr(os, "fork", refuse("os.fork"))
    patch.setattr(os, "posix_spawn", refuse("os.posix_spawn"))
    try:
        yield
    finally:
        patch.undo()
    if started:  # also when the code under test caught the exception
        pytest.fail(
            f"unit test {request.node.nodeid} started a process ({', '.join(started)}): "
            "mark it `integration` (pytestmark = pytest.mark.integration); see docs/testing.md",
            pytrace=False,
        )
