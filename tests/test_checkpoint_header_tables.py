"""A save's tensor and storage tables go to the server once per connection (header_tables.py):
later commits name them by number, the server puts them back, and a connection made anew is
sent them again in full; a region reserved ahead on a closed connection is never used."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import wait_for

from transom import checkpoint
from transom.checkpoint import worker_protocol as wire
from transom.checkpoint.header_tables import KEPT, UNKNOWN_TABLES, ConnectionTables
from transom.checkpoint.shard_header import ShardError, ShardHeader


def _commit(number: int | None, tables: bool, step: int = 1) -> wire.Commit:
    header = {"format": 1, "step": step, "rank": 0, "world_size": 1, "tree": {"T": 0}}
    header["data_len"] = 64
    if tables:
        header |= {
            "tensors": [{"dtype": "float32", "n": number}],
            "storages": [{"offset": 0, "nbytes": 64}],
        }
    return wire.Commit(step, 0, header, True, number)


def test_the_server_puts_back_the_tables_a_connection_sent_and_refuses_unknown_ones() -> None:
    kept = ConnectionTables()
    assert kept.header(_commit(None, True)) == ShardHeader.from_json(_commit(None, True).header)
    with pytest.raises(ShardError, match="tensors must be a list"):  # none sent, none named
        kept.header(_commit(None, False))
    with pytest.raises(ValueError, match=UNKNOWN_TABLES):
        kept.header(_commit(7, False))
    full = _commit(7, True)
    assert kept.header(full) == ShardHeader.from_json(full.header)
    again = kept.header(_commit(7, False, step=2))
    assert again == ShardHeader.from_json({**full.header, "step": 2})
    # The header put back together is checked like any other: of the commit's step and rank.
    with pytest.raises(ShardError, match="commit of step 3 rank 0 carries the header of step 2"):
        kept.header(wire.Commit(3, 0, _commit(7, False, step=2).header, True, 7))
    for number in range(8, 8 + KEPT):  # KEPT newer sets: the oldest is forgotten
        kept.header(_commit(number, True))
    with pytest.raises(ValueError, match=UNKNOWN_TABLES):
        kept.header(_commit(7, False))
    # A forged commit with only one of the tables gets the kept ones, whole.
    mixed = _commit(8, False)
    mixed.header["tensors"] = [{"forged": True}]
    assert kept.header(mixed).tensors == ({"dtype": "float32", "n": 8},)


def test_commits_send_the_tables_once_and_again_after_the_connection_is_made_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = checkpoint.Engine(storage_dir=tmp_path / "ckpt", rank=0, world_size=1)
    commits: list[tuple[int, bool]] = []  # (step, whether its header carried the tables)
    replies: list[object] = []
    real_request = engine.connection.request

    def request(req, *args, **kwargs):
        reply = real_request(req, *args, **kwargs)
        if isinstance(req, wire.Commit):
            commits.append((req.step, "tensors" in req.header))
            replies.append(reply)
        return reply

    real_send = engine.connection.send

    def send(req, on_reply):  # a commit of a save every step: its reply read by the next save
        assert isinstance(req, wire.Commit | wire.Reserve)
        if isinstance(req, wire.Commit):
            commits.append((req.step, "tensors" in req.header))
            index = len(replies)
            replies.append(None)

            def answered(reply):
                replies[index] = reply
                on_reply(reply)

            return real_send(req, answered)
        return real_send(req, on_reply)

    monkeypatch.setattr(engine.connection, "request", request)
    monkeypatch.setattr(engine.connection, "send", send)
    model = torch.nn.Linear(8, 4)
    try:
        for step in range(1, 5):
            with torch.no_grad():
                model.weight.fill_(float(step))
            assert engine.save(step, {"model": model.state_dict()}, overlap=True).ok
        engine._copy.wait_finished()
        assert commits == [(1, True), (2, False), (3, False), (4, False)]
        engine.connection.close()  # the server gives back what that connection reserved ahead
        server = engine.server
        assert server is not None
        wait_for(
            lambda: all(s.state != "reserved" for s in list(server.memory.shards.values())),
            10,
            "the closed connection's reservation given back",
        )
        with torch.no_grad():
            model.weight.fill_(5.0)
        handle = engine.save(5, {"model": model.state_dict()}, overlap=True)
        handle.wait("memory", timeout=30)
        # Named by number, refused as unknown on the new connection, sent again in full.
        assert commits[4:] == [(5, False), (5, True)]
        assert isinstance(replies[4], wire.Failed) and replies[4].error.startswith(UNKNOWN_TABLES)
        assert isinstance(replies[5], wire.Done)
        for step in (4, 5):
            loaded = engine.load(step=step)["model"]["weight"]
            assert torch.equal(loaded, torch.full((4, 8), float(step)))
    finally:
        engine.close()
