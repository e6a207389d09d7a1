"""`BadCopy`: the fields of a worker's `bad-copy` event, read by its node's server (which
withdraws a corrupt copy). The event's keys stay what they were, and fields that are not a bad
copy's are a `RecordError` (a ValueError: the server answers the request as a bad one)."""

from __future__ import annotations

import json

import pytest

from transom.checkpoint.bad_copy import BadCopy
from transom.checkpoint.worker_protocol import Event, parse_request
from transom.common.record_base import RecordError


def test_a_bad_copy_keeps_the_events_keys_and_round_trips_through_the_workers_socket() -> None:
    bad = BadCopy(3, 1, "peer", "checksum mismatch", "node-b", corrupt=True)
    fields = bad.to_dict()
    assert list(fields) == ["step", "rank", "tier", "error", "holder_node", "corrupt"]
    sent = Event("bad-copy", "rank 1 step 3: bad copy", fields)
    got = parse_request(json.loads(json.dumps(sent.to_msg())))
    assert isinstance(got, Event) and BadCopy.from_dict(got.fields) == bad
    assert BadCopy.from_dict({"step": 3, "rank": 1, "tier": "storage"}) == BadCopy(3, 1, "storage")


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"rank": 1, "tier": "memory"}, "missing field 'step'"),
        ({"step": "3", "rank": 1, "tier": "memory"}, "BadCopy.step: expected int"),
        ({"step": 3, "rank": True, "tier": "memory"}, "BadCopy.rank: expected int"),
        ({"step": -1, "rank": 1, "tier": "memory"}, "is not a shard's"),
        ({"step": 3, "rank": 1, "tier": 2}, "BadCopy.tier: expected str"),
        ({"step": 3, "rank": 1, "tier": "peer", "holder_node": 7}, "BadCopy.holder_node"),
        ({"step": 3, "rank": 1, "tier": "peer", "corrupt": "yes"}, "BadCopy.corrupt: expected"),
    ],
)
def test_fields_that_are_not_a_bad_copys_are_a_record_error(fields, message) -> None:
    with pytest.raises(RecordError, match=message):
        BadCopy.from_dict(fields)
