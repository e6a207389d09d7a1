"""`ShardHeader.from_json` and `Timeline.from_json`: the one reader of a shard's header, which
comes from files, peers and worker messages. Malformed input is a `ShardError` naming what is
wrong (never a KeyError or TypeError), and every valid header survives a round trip, through
JSON and through the format's bytes."""

from __future__ import annotations

import json

import pytest
import xxhash

from transom.checkpoint import shard_format, shard_header
from transom.checkpoint.header_tables import ConnectionTables
from transom.checkpoint.shard_header import DATA_CHUNK, ShardError, ShardHeader, Timeline
from transom.checkpoint.worker_protocol import Commit, Source


def _fields(**over) -> dict:
    data = bytes(100)
    fields = {
        "format": 1,
        "step": 7,
        "rank": 1,
        "world_size": 2,
        "tree": {"d": [["w", {"T": 0}]]},
        "tensors": [{"dtype": "uint8", "shape": [100], "stride": [1], "byte": 0, "storage": 0}],
        "storages": [{"offset": 0, "nbytes": 100}],
        "data_len": len(data),
        "timeline": {"job": "j", "generation": 3, "world_size": 2},
        "reshard": {"replicated": [], "sharded": []},
        "chunks": [xxhash.xxh3_64_hexdigest(data)],
    }
    fields.update(over)
    return {k: v for k, v in fields.items() if v is not ...}


def test_a_header_round_trips_through_json_and_the_formats_bytes() -> None:
    header = ShardHeader.from_json(_fields())
    assert header.step == 7 and header.rank == 1 and header.world_size == 2
    assert header.timeline == Timeline("j", 3, 2) and header.storages == ((0, 100),)
    assert ShardHeader.from_json(json.loads(json.dumps(header.to_json()))) == header
    decoded, offset = shard_format.decode_header(shard_format.encode_header(header))
    assert decoded == header and offset == shard_format.DATA_ALIGN
    bare = ShardHeader.from_json(_fields(timeline=..., reshard=..., chunks=...))
    assert bare.timeline is None and bare.reshard is None and bare.chunks == ()
    assert "timeline" not in bare.to_json() and ShardHeader.from_json(bare.to_json()) == bare
    assert ShardHeader.from_json(_fields(newer_field=1)) == header  # a newer writer's key


@pytest.mark.parametrize(
    "over, message",
    [
        ({"format": 2}, "format '2' is not supported"),
        ({"format": True}, "format 'True' is not supported"),
        ({"format": ...}, "format 'None' is not supported"),
        ({"step": ...}, "step must be an integer"),
        ({"step": -1}, "step must be an integer"),
        ({"step": "7"}, "step must be an integer"),
        ({"step": 1.0}, "step must be an integer"),
        ({"step": True}, "step must be an integer"),
        ({"step": 1 << 70}, "step must be an integer"),
        ({"rank": 2}, r"rank must be an integer in \[0, 1\]"),
        ({"rank": -1}, "rank must be an integer"),
        ({"world_size": 0}, "world_size must be an integer"),
        ({"world_size": 1 << 40}, "world_size must be an integer"),
        ({"data_len": -5}, "data_len must be an integer"),
        ({"data_len": None}, "data_len must be an integer"),
        ({"tree": ...}, "no value tree"),
        ({"tensors": {}}, "tensors must be a list"),
        ({"tensors": ...}, "tensors must be a list"),
        ({"tensors": [1]}, "not an object"),
        ({"storages": "x"}, "storages must be a list"),
        ({"storages": [[0, 100]]}, "storage table entry is not an object"),
        ({"storages": [{"offset": 0}]}, "nbytes must be an integer"),
        ({"storages": [{"offset": -1, "nbytes": 1}]}, "offset must be an integer"),
        ({"storages": [{"offset": 90, "nbytes": 20}]}, "outside the data"),
        ({"chunks": "abc"}, "chunks must be a list"),
        ({"chunks": ["00"] * 2}, "2 chunk checksums for 1 chunks"),
        ({"chunks": [1]}, "not xxh3-64 hex digests"),
        ({"chunks": ["zz" * 8]}, "not xxh3-64 hex digests"),
        ({"timeline": "j"}, "timeline must be an object"),
        ({"timeline": {"job": 1, "generation": 0, "world_size": 1}}, "job must be a string"),
        ({"timeline": {"job": "j", "generation": -1, "world_size": 1}}, "generation must be"),
        ({"timeline": {"job": "j", "generation": 0}}, "world_size must be"),
        ({"reshard": []}, "reshard record is not an object"),
    ],
)
def test_a_malformed_header_is_a_shard_error_that_says_what_is_wrong(over, message) -> None:
    with pytest.raises(ShardError, match=message):
        ShardHeader.from_json(_fields(**over))


@pytest.mark.parametrize("value", [None, [], "header", 1, True])
def test_a_header_that_is_not_an_object_is_a_shard_error(value) -> None:
    with pytest.raises(ShardError, match="must be an object"):
        ShardHeader.from_json(value)


def test_absurd_table_lengths_are_refused_before_they_are_walked(monkeypatch) -> None:
    monkeypatch.setattr(shard_header, "MAX_TABLE", 10)
    with pytest.raises(ShardError, match="11 entries: implausible"):
        ShardHeader.from_json(_fields(tensors=[{}] * 11))
    with pytest.raises(ShardError, match="5 chunk checksums for 1 chunks"):
        ShardHeader.from_json(_fields(chunks=["0" * 16] * 5))
    with pytest.raises(ShardError, match="0 chunks"):  # no data, yet checksums
        ShardHeader.from_json(_fields(data_len=0, storages=[], chunks=["0" * 16]))
    assert ShardHeader.from_json(_fields(data_len=2 * DATA_CHUNK, chunks=["0" * 16] * 2))


def test_the_bytes_of_a_malformed_header_are_refused_when_decoded() -> None:
    from conftest import raw_shard_header

    with pytest.raises(ShardError, match="rank must be"):
        shard_format.decode_header(raw_shard_header(_fields(rank="1")))
    with pytest.raises(ShardError, match="does not match its prefix"):
        good = bytearray(raw_shard_header(_fields()))
        shard_format.PREFIX.pack_into(good, 0, *shard_format.PREFIX.unpack_from(good)[:4], 99)
        shard_format.decode_header(bytes(good))


def test_timeline_parse_is_none_for_anything_but_a_timeline() -> None:
    assert Timeline.parse({"job": "j", "generation": 0, "world_size": 1}) == Timeline("j", 0, 1)
    for bad in (None, {}, {"job": "j", "generation": "0", "world_size": 1}, [1, 2, 3]):
        assert Timeline.parse(bad) is None


def test_worker_messages_carry_a_checked_header() -> None:
    header = ShardHeader.from_json(_fields(chunks=...))
    commit = Commit(7, 1, header.to_json())
    assert Commit.parse(json.loads(json.dumps(commit.to_msg()))) == commit
    # The server reads a commit's header (its tables put back) before it takes the commit.
    assert ConnectionTables().header(commit) == header
    with pytest.raises(ShardError, match="carries the header of step 7 rank 1"):
        ConnectionTables().header(Commit.parse({**commit.to_msg(), "step": 8}))
    with pytest.raises(ShardError, match="world_size must be"):
        ConnectionTables().header(Commit(7, 1, _fields(world_size="2")))
    with pytest.raises(ValueError, match="needs the shard's header"):
        Commit.parse({"op": "commit", "step": 7, "rank": 1})
    source = Source("memory", "n0", "/dev/shm/x", header=header)
    assert Source.parse(json.loads(json.dumps(source.to_msg()))) == source
    with pytest.raises(ShardError, match="must be an object"):
        Source.parse({"tier": "memory", "header": "x"})
