"""Unit tests for transom/job_spec.py: --nnodes parsing, JobSpec validation, the run directory."""

from __future__ import annotations

import argparse
import os

import pytest

from transom.job_spec import (
    ConfigError,
    JobSpec,
    add_job_options,
    job_options,
    new_job_id,
    parse_nnodes,
    parse_size,
    prepare_run_dir,
)

# -- parse_nnodes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("3", (3, 3)),
        ("2:4", (2, 4)),
        (" 2 : 4 ", (2, 4)),
        ("1:1", (1, 1)),
        (5, (5, 5)),
    ],
)
def test_parse_nnodes(text, expected):
    assert parse_nnodes(text) == expected


@pytest.mark.parametrize("text", ["", "a", "2:", ":4", "1:2:3", "-1", "2-4", "1.5", "two"])
def test_parse_nnodes_rejects_bad_forms(text):
    with pytest.raises(ConfigError, match="expected N or MIN:MAX"):
        parse_nnodes(text)


@pytest.mark.parametrize("text", ["0", "0:2"])
def test_parse_nnodes_rejects_zero(text):
    with pytest.raises(ConfigError, match="at least 1 node"):
        parse_nnodes(text)


def test_parse_nnodes_rejects_max_below_min():
    with pytest.raises(ConfigError, match="MAX is smaller than MIN"):
        parse_nnodes("4:2")


# -- JobSpec.validate ------------------------------------------------------------------------------


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def test_valid_spec_passes(script):
    spec = JobSpec(script=script, nnodes_min=2, nnodes_max=4, spares=1, nproc_per_node=2)
    assert spec.validate() is spec
    assert spec.world_size == 8


def test_missing_script(tmp_path):
    with pytest.raises(ConfigError, match="script not found"):
        JobSpec(script=str(tmp_path / "nope.py")).validate()
    # A directory is not a script either.
    with pytest.raises(ConfigError, match="script not found"):
        JobSpec(script=str(tmp_path)).validate()


def test_missing_script_is_not_checked_when_asked_not_to(tmp_path):
    JobSpec(script=str(tmp_path / "nope.py")).validate(check_script=False)


@pytest.mark.parametrize("low, high", [(0, 1), (0, 0), (3, 2), (-1, 2)])
def test_bad_nnodes(script, low, high):
    with pytest.raises(ConfigError, match="--nnodes"):
        JobSpec(script=script, nnodes_min=low, nnodes_max=high).validate()


def test_negative_spares(script):
    with pytest.raises(ConfigError, match="--spares -1: cannot be negative"):
        JobSpec(script=script, spares=-1).validate()


def test_more_spares_than_nodes(script):
    JobSpec(script=script, nnodes_min=1, nnodes_max=2, spares=2).validate()
    with pytest.raises(ConfigError, match="--spares 3"):
        JobSpec(script=script, nnodes_min=1, nnodes_max=2, spares=3).validate()


@pytest.mark.parametrize("nproc", [0, -2])
def test_no_workers_per_node(script, nproc):
    with pytest.raises(ConfigError, match="--nproc-per-node"):
        JobSpec(script=script, nproc_per_node=nproc).validate()


def test_negative_max_restarts_and_short_ttl(script):
    with pytest.raises(ConfigError, match="--max-restarts"):
        JobSpec(script=script, max_restarts=-1).validate()
    with pytest.raises(ConfigError, match="--node-ttl"):
        JobSpec(script=script, node_ttl_s=1).validate()


@pytest.mark.parametrize("job_id", ["", "-job", ".job", "bad/id", "has space", "a" * 65, "ünï"])
def test_bad_job_id(script, job_id):
    with pytest.raises(ConfigError, match="--job-id"):
        JobSpec(script=script, job_id=job_id).validate()


@pytest.mark.parametrize("job_id", ["job-1", "a", "A.b_c-9", "a" * 64])
def test_good_job_id(script, job_id):
    JobSpec(script=script, job_id=job_id).validate()


def test_new_job_ids_are_valid_and_distinct(script):
    ids = {new_job_id() for _ in range(20)}
    assert len(ids) == 20
    for job_id in ids:
        JobSpec(script=script, job_id=job_id).validate()


# -- prepare_run_dir -------------------------------------------------------------------------------


def test_prepare_run_dir_creates_nested_directories(tmp_path):
    run_dir = prepare_run_dir(tmp_path / "a" / "b")
    assert run_dir == (tmp_path / "a" / "b").resolve()
    assert run_dir.is_dir()
    assert list(run_dir.iterdir()) == []  # the write probe is removed
    assert prepare_run_dir(run_dir) == run_dir  # existing is fine


def test_prepare_run_dir_under_a_file_raises_config_error(tmp_path):
    # Root ignores permission bits, so make mkdir fail with a regular file in the path.
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="cannot be written"):
        prepare_run_dir(blocker / "run")
    with pytest.raises(ConfigError, match="cannot be written"):
        prepare_run_dir(blocker)  # the path itself is a file


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits")
def test_prepare_run_dir_read_only(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match="cannot be written"):
            prepare_run_dir(ro)
    finally:
        ro.chmod(0o700)


# -- serialisation ---------------------------------------------------------------------------------


def test_to_dict_from_dict_round_trip(script):
    spec = JobSpec(
        script=script,
        script_args=["--steps", "5"],
        job_id="job-x",
        nnodes_min=2,
        nnodes_max=3,
        spares=1,
        nproc_per_node=2,
        max_restarts=7,
        evict_window_s=12.5,
        node_ttl_s=6,
        join_timeout_s=3.0,
    )
    data = spec.to_dict()
    assert data["script_args"] == ["--steps", "5"]
    again = JobSpec.from_dict(data)
    assert again == spec
    assert again.to_dict() == data


def test_from_dict_ignores_unknown_keys(script):
    data = JobSpec(script=script, job_id="job-y").to_dict() | {"added_in_a_later_version": 1}
    assert JobSpec.from_dict(data) == JobSpec(script=script, job_id="job-y")


# -- the options JobSpec declares -----------------------------------------------------------------


def _parse(*argv: str, resolve_faults=None) -> JobSpec:
    parser = argparse.ArgumentParser()
    add_job_options(parser)
    args = parser.parse_args(list(argv))
    return JobSpec.from_args(args, resolve_faults=resolve_faults, script="s.py", job_id="j")


def test_no_options_give_the_dataclass_defaults():
    assert _parse() == JobSpec(script="s.py", job_id="j")


def test_every_option_sets_its_field():
    seen = []
    spec = _parse(
        *("--nnodes", "2:4", "--spares", "1", "--nproc-per-node", "2", "--max-restarts", "7"),
        *("--evict-window", "12.5", "--node-ttl", "6", "--join-timeout", "3"),
        *("--warmup-timeout", "60", "--settle-time", "2", "--hang-floor", "12.5"),
        *("--store-outage", "45"),
        *(
            "--no-warm-workers",
            "--no-auto-monitor",
            "--faults",
            "crash@step=4",
            "--fault-seed",
            "9",
        ),
        *("--metrics-port", "-1", "--ckpt-memory", "1.5G", "--ckpt-storage", "rel/dir"),
        *("--ckpt-keep", "5", "--ckpt-replicas", "0"),
        resolve_faults=lambda text, world, seed: seen.append((text, world, seed)) or ["F"],
    )
    assert (spec.nnodes_min, spec.nnodes_max, spec.spares, spec.nproc_per_node) == (2, 4, 1, 2)
    assert (spec.max_restarts, spec.evict_window_s, spec.node_ttl_s) == (7, 12.5, 6)
    assert (spec.join_timeout_s, spec.warmup_timeout_s, spec.settle_s) == (3.0, 60.0, 2.0)
    assert spec.hang_floor_s == 12.5 and spec.warm_workers is False
    assert spec.auto_monitor is False
    assert spec.store_outage_s == 45.0
    # The fault schedule is resolved against the world size and the seed.
    assert spec.faults == ["F"] and seen == [("crash@step=4", 8, 9)] and spec.fault_seed == 9
    assert spec.metrics_port == -1 and spec.ckpt_memory_bytes == 3 << 29
    assert spec.ckpt_storage == os.path.abspath("rel/dir")
    assert (spec.ckpt_keep, spec.ckpt_replicas) == (5, 0)
    # Each option was exercised: a field added later with an option must be added here too.
    defaults = JobSpec(script="s.py", job_id="j")
    changed = {
        f.name for f, _ in job_options() if getattr(spec, f.name) != getattr(defaults, f.name)
    }
    assert changed == {f.name for f, _ in job_options()}


def test_options_are_checked_by_validate(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    for argv, message in [
        (("--warmup-timeout", "0"), "--warmup-timeout 0.0: must be positive"),
        (("--settle-time", "31"), "--settle-time 31.0: between 0 and 30 seconds"),
        (("--settle-time", "-1"), "--settle-time"),
        (("--hang-floor", "0.5"), "--hang-floor 0.5: at least 1 second"),
        (("--store-outage", "-1"), "--store-outage -1.0: cannot be negative"),
        (("--node-ttl", "1"), "--node-ttl 1: at least 2 seconds"),
        (("--metrics-port", "70000"), "--metrics-port"),
        (("--ckpt-keep", "0"), "--ckpt-keep 0"),
    ]:
        spec = _parse(*argv)
        spec.script = str(script)
        with pytest.raises(ConfigError, match=message):
            spec.validate()


def test_bad_option_text_is_a_config_error():
    with pytest.raises(ConfigError, match="expected N or MIN:MAX"):
        _parse("--nnodes", "two")
    with pytest.raises(ConfigError, match="is not a size"):
        _parse("--ckpt-memory", "lots")
    with pytest.raises(ConfigError, match="--faults cannot be used here"):
        _parse("--faults", "crash@step=1")  # nothing to resolve them with


def test_help_shows_the_dataclass_defaults():
    parser = argparse.ArgumentParser()
    add_job_options(parser)
    text = " ".join(parser.format_help().split())
    assert "--warmup-timeout SECONDS a generation whose nodes" in text
    for shown in ("(default: 120)", "(default: 0.5)", "(default: 8)", "(default: 300)"):
        assert shown in text
    assert "(default: half of the node's memory)" in text
    assert "--no-warm-workers" in text


@pytest.mark.parametrize(
    "text, size", [("8G", 8 << 30), ("512MiB", 512 << 20), ("1.5g", 3 << 29), ("1000", 1000)]
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "G", "lots", "0", "-1G"])
def test_parse_size_rejects_non_sizes(text):
    with pytest.raises(ConfigError):
        parse_size(text)
