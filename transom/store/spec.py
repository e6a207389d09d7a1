"""The job spec read back from etcd, checked before any reader acts on it.

The spec (`spec` key) says which script every node runs, with which arguments and faults; it
crossed a process boundary, so every reader (node agent, controller candidate, a launcher
joining a job) takes it through `read_spec` / `parse_spec`: types (`JobSpec.from_dict`), values
and ids (`JobSpec.validate`), that it names this job, and that its faults are faults. A bad
spec is a `ConfigError` with one line saying what is wrong, and a warning event in the job's log,
never a traceback. This module must never start anything.
"""

from __future__ import annotations

import time
from typing import Any

from transom.common import keys
from transom.common.records import Event, EventKind, RecordError
from transom.job_spec import ConfigError, JobSpec
from transom.store.access import StoreError
from transom.store.etcd_client import Store

EVENT_SOURCE_SUFFIX = "-spec"
SPEC_WAIT_S = 120.0  # how long a controller or agent waits for the spec (it may start first)


def parse_spec(value: Any, job_id: str, check_script: bool) -> JobSpec:
    """The stored spec `value` of job `job_id`, validated (`check_script`: the script must be a
    readable file here, for a reader that runs it); ConfigError saying what is wrong."""
    from transom.faults.schedule import check_type

    try:
        spec = JobSpec.from_dict(value).validate(check_script=check_script)
        if spec.job_id != job_id:
            raise ConfigError(f"it names job {spec.job_id!r}, not {job_id!r}")
        for i, fault in enumerate(spec.faults):
            try:
                check_type(fault)
            except RecordError as e:
                raise ConfigError(f"fault {i}: {e}") from None
    except ConfigError as e:
        raise ConfigError(f"the job spec of {job_id} in etcd is refused: {e}") from None
    return spec


def read_spec(store: Store, timeout_s: float, check_script: bool, reader: str) -> JobSpec:
    """The job's spec once it is in etcd (StoreError after `timeout_s`), validated by
    `parse_spec`. A refused spec is also reported as a warning event written by `reader`."""
    value = store.wait_for(keys.SPEC, timeout_s)
    try:
        return parse_spec(value, store.job_id, check_script)
    except ConfigError as e:
        now = time.time()
        event = Event(now, EventKind.WARNING, f"{reader}: {e}", writer=reader)
        try:
            store.put(keys.event(now, reader + EVENT_SOURCE_SUFFIX), event.to_dict())
        except StoreError:
            pass  # the refusal itself is what matters; the caller reports it
        raise
