"""Restoring the newest step: the plan names the oldest step to restore (the catalog's newest,
which lags the saves), the ranks restore the newest one they hold at or after it, and never one
at or after a rollback's bound; a replacement node finds its rank's newest step in a peer's
memory by asking the peer (the `list` request), not the catalog."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import wait_for

from transom import checkpoint
from transom.checkpoint import catalog, replication
from transom.checkpoint.server import CheckpointServer
from transom.checkpoint.server_options import ServerConfig, store_options
from transom.common import env, keys
from transom.common.records import Plan
from transom.common.states import JobState
from transom.store import EmbeddedEtcd, Store

SECRET = b"the job's secret"
JOB = "newest"


@pytest.mark.parametrize(
    "reply, problem",
    [
        ({"ok": False, "error": "no"}, "bad listing"),
        ({"ok": True, "held": "3"}, "bad listing"),
        ({"ok": True, "held": [[1, 1]] * (replication.MAX_LISTED + 1)}, "bad listing"),
        ({"ok": True, "held": [[1]]}, "bad entry"),
        ({"ok": True, "held": [[-1, 1]]}, "bad entry"),
        ({"ok": True, "held": [[1, 0]]}, "bad entry"),
        ({"ok": True, "held": [[True, 1]]}, "bad entry"),
        ({"ok": True, "held": [[1.0, 1]]}, "bad entry"),
        ({"ok": True, "held": [{"step": 1}]}, "bad entry"),
    ],
)
def test_a_peers_listing_is_checked_entry_by_entry(reply: dict, problem: str) -> None:
    with pytest.raises(replication.ReplicationError, match=problem):
        replication.parse_listing(reply, "127.0.0.1:1")


def test_a_valid_listing_and_list_request_are_parsed() -> None:
    assert replication.parse_listing({"ok": True, "held": [[5, 2], [4, 2]]}, "a") == [
        (5, 2),
        (4, 2),
    ]
    assert replication.parse_request({"op": "list", "rank": 3}) == replication.ListRequest(3)
    with pytest.raises(ValueError, match="rank must be an integer"):
        replication.parse_request({"op": "list", "rank": -3})


def _server(tmp_path: Path, node: str, etcd) -> CheckpointServer:
    cfg = ServerConfig(
        node_id=node,
        socket_path=tmp_path / f"{node}.sock",
        shm_dir=Path("/dev/shm") / f"transom-test-{tmp_path.name}-{node}",
        budget_bytes=1 << 28,
        replicas=1,
        ranks_per_node=1,
        secret=SECRET,
        job_id=JOB,
        **store_options(etcd.access),
    )
    return CheckpointServer(cfg).start()


def _state(step: int) -> dict:
    return {"w": torch.full((1000,), float(step)), "step": step}


@pytest.mark.integration
def test_ranks_restore_the_newest_step_held_at_or_after_the_plans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(env.JOB_ID, JOB)
    with EmbeddedEtcd(tmp_path / "etcd") as etcd:
        store = Store(etcd.access, JOB)
        plan = Plan(generation=1, members=["node0", "node1"], job_state=JobState.RUNNING)
        store.put(keys.PLAN, plan.to_dict())
        servers = [_server(tmp_path, "node0", etcd), _server(tmp_path, "node1", etcd)]
        try:
            wait_for(
                lambda: catalog.servers(store).keys() >= {"node0", "node1"},
                10,
                "both servers registered",
            )
            saver = checkpoint.Engine(
                socket_path=str(servers[0].cfg.socket_path), rank=0, world_size=1, secret=SECRET
            )
            for step in (1, 2, 3, 4):
                saver.save(step, _state(step), persist=False).wait("peer", timeout=30)
            saver.close()
            wait_for(lambda: "mem-node1" in catalog.holders(store, 4, 0), 10, "step 4 listed")

            # A survivor: its own memory holds steps 3 and 4 (it keeps two; 2 may not have
            # made way yet).
            monkeypatch.setenv(env.RESTORE_STEP, "1")
            survivor = checkpoint.Engine(
                socket_path=str(servers[0].cfg.socket_path), rank=0, world_size=1, secret=SECRET
            )
            held = survivor.newer_held(1)
            assert held[:2] == [4, 3] and held[-1] == 1 and held == sorted(held, reverse=True)
            assert survivor.load()["step"] == 4
            monkeypatch.setenv(env.RESTORE_BEFORE, "4")  # a rollback: step 4 is poisoned
            assert survivor.load()["step"] == 3
            monkeypatch.delenv(env.RESTORE_BEFORE)
            survivor.close()

            # node0 dies; node2 replaces it and holds nothing. No memory holds step 1 (the
            # plan's) any more (node1 keeps the newest replica, step 4), so node2 asks the node
            # that ran rank 0 before (gone) and its ring peer, node1. (A withdrawn listing goes
            # to etcd with the server's next batch, 10 s after at the latest: lazy listings.)
            wait_for(
                lambda: not catalog.holders(store, 1, 0), 15, "step 1's memory listing withdrawn"
            )
            servers[0].stop()
            after = Plan(2, ["node2", "node1"], JobState.RUNNING, previous_members=plan.members)
            store.put(keys.PLAN, after.to_dict())
            servers.append(_server(tmp_path, "node2", etcd))
            wait_for(lambda: servers[2].publisher.plan.generation == 2, 10, "node2 reads the plan")
            newcomer = checkpoint.Engine(
                socket_path=str(servers[2].cfg.socket_path), rank=0, world_size=1, secret=SECRET
            )
            assert newcomer.newer_held(1) == [4, 1]
            state = newcomer.load()
            assert state["step"] == 4 and torch.equal(state["w"], _state(4)["w"])
            assert newcomer.last_load.tier == "peer"
            newcomer.close()
        finally:
            for server in servers:
                server.stop()
