"""`ReshardRecord.from_json`: the one reader of a shard's resharding record, which comes with the
header from files, peers and worker messages. The JSON stays what reshard.py always wrote (old
checkpoints load), and a malformed record is a `RecordError` naming what is wrong (a ShardError
when the header carrying it is read), never a KeyError or TypeError from deeper in."""

from __future__ import annotations

import json

import pytest

from transom.checkpoint.reshard_record import ReshardRecord, ShardedTensor
from transom.checkpoint.shard_header import ShardError, ShardHeader
from transom.common.record_base import RecordError

SAVED = {  # the record as reshard.py wrote it before it was typed
    "replicated": [["model"], ["optim", "state", 0]],
    "sharded": [[["w"], {"global_shape": [10, 3], "offsets": [4, 0], "dim": 0}]],
}


def test_the_record_reads_and_writes_the_json_reshard_py_always_wrote() -> None:
    record = ReshardRecord.from_json(SAVED)
    assert record.replicated == (("model",), ("optim", "state", 0))
    assert record.chunks() == {("w",): ShardedTensor((10, 3), (4, 0), 0)}
    assert not record.dcp
    assert json.dumps(record.to_json()) == json.dumps(SAVED)  # byte for byte, keys in order
    assert ReshardRecord.from_json({"dcp": True}).to_json() == {"dcp": True}
    marked = {"replicated": [["model"]], "sharded": []}  # a state without DTensors
    assert ReshardRecord.from_json(marked).to_json() == marked
    other_mesh = {"global_shape": [4], "offsets": [0], "dim": None}
    assert ShardedTensor.from_json(other_mesh).to_json() == other_mesh
    assert ReshardRecord.from_json({"replicated": [["a"]], "newer": 1}).replicated == (("a",),)


@pytest.mark.parametrize(
    "value, message",
    [
        ({"dcp": 1}, "dcp must be true or false"),
        ({"replicated": "model"}, "replicated must be a list"),
        ({"replicated": ["model"]}, "replicated path 0 must be a list of strings and integers"),
        ({"replicated": [["a", 1.5]]}, "replicated path 0 must be a list of strings"),
        ({"replicated": [["a", True]]}, "replicated path 0 must be a list of strings"),
        ({"sharded": {}}, "sharded must be a list"),
        ({"sharded": [["w"]]}, r"sharded entry 0 must be \[path, chunk\]"),
        ({"sharded": [[{"w": 1}, {}]]}, "sharded path 0 must be a list"),
        ({"sharded": [[["w"], []]]}, "sharded entry 0 must be an object"),
        ({"sharded": [[["w"], {"offsets": [0]}]]}, "global_shape must be a list of non-negative"),
        ({"sharded": [[["w"], {"global_shape": [-1], "offsets": [0]}]]}, "global_shape must be"),
        ({"sharded": [[["w"], {"global_shape": ["3"], "offsets": [0]}]]}, "global_shape must be"),
        ({"sharded": [[["w"], {"global_shape": [3]}]]}, "offsets must be a list"),
        ({"sharded": [[["w"], {"global_shape": [3], "offsets": [0, 0]}]]}, "2 offsets for 1"),
        ({"sharded": [[["w"], {"global_shape": [3], "offsets": [0], "dim": 1}]]}, "dim must be"),
        ({"sharded": [[["w"], {"global_shape": [3], "offsets": [0], "dim": "0"}]]}, "dim must"),
    ],
)
def test_a_malformed_record_is_a_record_error_that_says_what_is_wrong(value, message) -> None:
    with pytest.raises(RecordError, match=message):
        ReshardRecord.from_json(value)


@pytest.mark.parametrize("value", [None, [], "replicated", 1])
def test_a_record_that_is_not_an_object_is_a_record_error(value) -> None:
    with pytest.raises(RecordError, match="must be an object"):
        ReshardRecord.from_json(value)


def test_the_header_carries_the_record_typed_and_refuses_a_malformed_one() -> None:
    fields = {"format": 1, "step": 1, "rank": 0, "world_size": 1, "tree": None, "data_len": 0}
    fields |= {"tensors": [], "storages": []}
    header = ShardHeader.from_json({**fields, "reshard": SAVED})
    assert header.reshard == ReshardRecord.from_json(SAVED)
    assert header.to_json()["reshard"] == SAVED
    bad = {"sharded": [[["w"], {"global_shape": [3], "offsets": [0], "dim": 5}]]}
    with pytest.raises(ShardError, match="reshard record is malformed: sharded entry 0's dim"):
        ShardHeader.from_json({**fields, "reshard": bad})
