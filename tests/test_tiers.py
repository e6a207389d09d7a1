"""The test tiers (transom/testing/tier_plugin.py, docs/testing.md): every test gets exactly one, a
test that names two is refused, and a unit test that starts a process fails even when the code
under test swallows the error. Each case runs an inner pytest session in this process (pytester)."""

from __future__ import annotations

import pytest

CONFTEST = """
import pytest

@pytest.fixture
def etcd():  # only its name matters here: the tiers treat it as a real etcd
    return None

@pytest.fixture
def start_job(etcd):  # and this one as a whole job
    return None
"""

TESTS = """
import pytest

def test_plain():
    pass

def test_with_etcd(etcd):
    pass

@pytest.mark.slow
def test_old_slow():
    pass

@pytest.mark.e2e
def test_marked_e2e(etcd):
    pass

def test_whole_job(start_job):
    pass
"""


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_inprocess(
        "-p", "transom.testing.tier_plugin", "--strict-markers", *args
    )


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeini(
        "[pytest]\nmarkers =\n    unit: u\n    integration: i\n    e2e: e\n    slow: s\n"
    )
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_suite=TESTS)
    return pytester


@pytest.mark.parametrize(
    "tier, selected",
    [
        ("unit", ["test_plain"]),
        ("integration", ["test_with_etcd"]),
        ("e2e", ["test_old_slow", "test_marked_e2e", "test_whole_job"]),
    ],
)
def test_each_test_is_in_exactly_one_tier(suite, tier, selected):
    result = run(suite, "-m", tier, "--collect-only", "-q")
    collected = [line.split("::")[1] for line in result.outlines if "::" in line]
    assert collected == selected


def test_two_tiers_on_one_test_are_refused(pytester):
    pytester.makeini("[pytest]\nmarkers =\n    unit: u\n    integration: i\n    e2e: e\n")
    pytester.makepyfile(
        test_two="""
import pytest
pytestmark = pytest.mark.integration

@pytest.mark.e2e
def test_both():
    pass
"""
    )
    result = run(pytester, "--collect-only", "-q")
    assert result.ret != 0
    assert "is marked e2e and integration" in "\n".join(result.errlines + result.outlines)


@pytest.mark.integration  # its inner integration test starts a process (`true`)
def test_a_unit_test_that_starts_a_process_fails_even_if_the_error_is_swallowed(pytester):
    pytester.makeini("[pytest]\nmarkers =\n    unit: u\n    integration: i\n    e2e: e\n")
    pytester.makepyfile(
        test_proc="""
import subprocess
import pytest

def test_swallows():
    try:
        subprocess.run(["true"])
    except Exception:
        pass

@pytest.mark.integration
def test_allowed():
    subprocess.run(["true"], check=True)
"""
    )
    result = run(pytester, "-v")
    assert result.ret != 0
    # The unit test's check runs at its teardown: its call passes, its teardown is the error.
    result.stdout.fnmatch_lines(["*test_swallows ERROR*", "*test_allowed PASSED*"])
    assert "unit test test_proc.py::test_swallows started a process" in result.stdout.str()
