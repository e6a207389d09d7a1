"""Bad bytes: every malformed shard raises the format's error (`ShardError`), never another
exception, so the loader falls back to the next tier. Fuzz-style, fast and seeded."""

from __future__ import annotations

import copy
import json
import random
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import xxhash

from transom import checkpoint
from transom.checkpoint import flatten, layout, shard_format

NASTY = [
    -1,
    0,
    1,
    2**31,
    2**63,
    2**70,
    -(2**70),
    1e308,
    float("nan"),
    "x",
    "",
    "cuda:99",
    "nosuchdevice",
    [],
    [-1],
    [2**62, 2**62],
    [0] * 100,
    {},
    {"T": 0},
    None,
    True,
    {"dev": "nosuchdevice:3"},
    {"dev": "cuda:-5"},
    {"dt": "object"},
    {"sz": [-1]},
    {"sz": [2**70]},
    {"i": "9" * 5000},
    {"f": "0x1p99999"},
    {"c": ["x"]},
    {"y": "!!"},
    {"od": [[1]]},
    {"d": [[{"l": []}, 1]]},
]


def _state():
    return {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "view": torch.arange(12, dtype=torch.float32)[2:8],
        "expanded": torch.randn(3, 1).expand(3, 4),
        "od": OrderedDict(a=1, b=[1.5, "s", b"y", (2, 3)]),
        "dev": torch.device("cpu"),
        "size": torch.Size([2, 3]),
        "dtype": torch.float16,
    }


def _valid() -> tuple[dict, torch.Tensor]:
    """A shard's header as JSON (what a forger can change) and its data."""
    plan = flatten.plan_state(_state(), 1, 0, 1, shard_format.Timeline("j", 0, 1))
    data = torch.zeros(plan.data_len, dtype=torch.uint8)
    flatten.copy_into(plan, data)
    return plan.header.to_json(), data


def _paths(node, path=()):
    """Every (path, value) inside a JSON-like tree."""
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*path, i))


def _set(tree, path, value):
    for p in path[:-1]:
        tree = tree[p]
    tree[path[-1]] = value


def _rebuild_or_shard_error(header: dict, data: torch.Tensor) -> None:
    try:
        state = layout.rebuild(shard_format.ShardHeader.from_json(header), data)
    except shard_format.ShardError:
        return
    # What rebuilds must be usable: every tensor can be read without a crash or huge memory.
    for _, v in _paths(state if isinstance(state, (dict, list)) else {}):
        if isinstance(v, torch.Tensor):
            v.sum()


def test_every_mutation_of_a_header_is_a_good_state_or_a_shard_error() -> None:
    header, data = _valid()
    paths = [p for p, _ in _paths(header) if p and p[0] != "chunks"]
    rng = random.Random(13)
    for _ in range(3000):
        h = copy.deepcopy(header)
        for _ in range(rng.randint(1, 3)):
            path = rng.choice(paths)
            try:
                _set(h, path, copy.deepcopy(rng.choice(NASTY)))
            except (KeyError, IndexError, TypeError):
                pass
        _rebuild_or_shard_error(h, data)


@pytest.mark.parametrize(
    "tree, tensors, message",
    [
        ({"l": []}, [], None),  # placeholder replaced below by a deep tree
        ({"dev": "nosuchdevice"}, [], "malformed"),
        (
            {"T": 0},
            [{"dtype": "float32", "shape": [1 << 40], "stride": [0], "byte": 0, "storage": 0}],
            "zero stride",
        ),
        (
            {"T": 0},
            [{"dtype": "float32", "shape": [2, 2], "stride": [0, -1], "byte": 0, "storage": 0}],
            "bad shape",
        ),
        (
            {"T": 0},
            [{"dtype": "float32", "shape": [2**70], "stride": [1], "byte": 0, "storage": 0}],
            "bad shape",
        ),
        (
            {"T": 0},
            [
                {
                    "dtype": "float32",
                    "shape": [1] * 100,
                    "stride": [1] * 100,
                    "byte": 0,
                    "storage": 0,
                }
            ],
            "bad shape",
        ),
        (
            {"T": True},
            [{"dtype": "float32", "shape": [1], "stride": [1], "byte": 0, "storage": 0}],
            "not in",
        ),
    ],
)
def test_crafted_headers_raise_the_formats_error(tree, tensors, message) -> None:
    if tree == {"l": []}:
        tree = {"l": []}
        for _ in range(5000):
            tree = {"l": [tree]}
        message = "deeper"
    header = {
        "format": 1,
        "step": 1,
        "rank": 0,
        "world_size": 1,
        "tree": tree,
        "tensors": tensors,
        "storages": [{"offset": 0, "nbytes": 64}],
        "data_len": 64,
    }
    with pytest.raises(shard_format.ShardError, match=message):
        layout.rebuild(
            shard_format.ShardHeader.from_json(header), torch.zeros(64, dtype=torch.uint8)
        )


def test_a_deeply_nested_json_header_is_a_shard_error(tmp_path: Path) -> None:
    body = ("[" * 100_000 + "]" * 100_000).encode()
    checksum = xxhash.xxh3_64_intdigest(body)
    prefix = shard_format.PREFIX.pack(
        shard_format.MAGIC, shard_format.FORMAT_VERSION, len(body), checksum, 0
    )
    with pytest.raises(shard_format.ShardError, match="not valid JSON"):
        shard_format.decode_header(prefix + body)
    (tmp_path / "deep").write_bytes(prefix + body + b"\0" * 4096)
    with pytest.raises(shard_format.ShardError):
        checkpoint.load(tmp_path / "deep")


def test_random_bytes_and_bit_flips_of_a_shard_file_are_shard_errors(tmp_path: Path) -> None:
    path = tmp_path / "good"
    checkpoint.save(_state(), path)
    good = path.read_bytes()
    rng = random.Random(7)
    for i in range(300):
        bad = bytearray(good)
        if i % 3 == 0:
            bad = bytearray(rng.randbytes(rng.randint(0, len(good))))
        else:
            for _ in range(rng.randint(1, 8)):
                bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(bad))
        try:
            checkpoint.load(path)
        except shard_format.ShardError:
            pass


def test_a_shard_of_another_timeline_is_refused_by_rebuild() -> None:
    fields, data = _valid()
    header = shard_format.ShardHeader.from_json(fields)
    layout.rebuild(header, data, shard_format.Timeline("j", 0, 1))
    for other in (
        shard_format.Timeline("j", 0, 2),
        shard_format.Timeline("j", 1, 1),
        shard_format.Timeline("k", 0, 1),
    ):
        with pytest.raises(shard_format.ShardError, match="timeline"):
            layout.rebuild(header, data, other)
    assert json.loads(json.dumps(header.to_json()))["timeline"] == {
        "job": "j",
        "generation": 0,
        "world_size": 1,
    }


@pytest.mark.parametrize("size", [0, 100, 1024, 1025, 5000])
def test_chunk_checksums_are_the_same_with_one_chunk_or_many(monkeypatch, size) -> None:
    monkeypatch.setattr(shard_format, "DATA_CHUNK", 1024)  # several chunks without 64 MiB
    data = memoryview(random.Random(size).randbytes(size))
    expected = [xxhash.xxh3_64_hexdigest(data[i : i + 1024]) for i in range(0, size, 1024)]
    assert shard_format.checksum_data(data) == expected
    if size > 1024:  # a flipped byte in the last chunk is found there, by the pool's threads
        flipped = bytearray(data)
        flipped[-1] ^= 1
        with pytest.raises(shard_format.ShardError, match=rf"chunk\(s\) \[{len(expected) - 1}\]"):
            header = shard_format.ShardHeader(1, 0, 1, size, chunks=tuple(expected))
            shard_format.verify_data(header, memoryview(bytes(flipped)))
