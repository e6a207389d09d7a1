"""torch.distributed.checkpoint through Transom's tiers: a StorageWriter and a StorageReader.

    from transom.checkpoint.dcp import TransomWriter, TransomReader
    dcp.save(state_dict, storage_writer=TransomWriter(engine), checkpoint_id=step)
    dcp.load(state_dict, storage_reader=TransomReader(engine), checkpoint_id=step)

Each rank's write items become one shard of `step` (engine.save: a copy into the node's checkpoint
memory; replication and persistence follow in the background). The coordinator's shard also
carries DCP's global metadata, encoded as a tree of plain values (no pickle), so a load can
reshard: any rank reads the items it needs from any saved rank's shard, from the fastest tier
that holds it (local memory, a peer, storage). DCP's own "bytes" items (objects DCP serialised
itself) are stored as opaque bytes; DCP decides how to read them back. Checkpoint ids are steps.
Each shard is declared a DCP shard (reshard.DcpShard), so the controller counts a step saved by
a world of another size as restorable: DCP's planner re-slices it (DTensors, ShardedTensors).
"""

from __future__ import annotations

import io
import os
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from transom.checkpoint.client import CheckpointError
from transom.checkpoint.engine import Engine
from transom.checkpoint.reshard import DcpShard
from transom.checkpoint.save_handle import SaveHandle


def _index_key(index: MetadataIndex) -> str:
    offset = "" if index.offset is None else ",".join(str(int(o)) for o in index.offset)
    return f"{index.fqn}@{offset}"


# -- DCP metadata as a tree of plain values --------------------------------------------------


def _encode_metadata(md: Metadata) -> dict[str, Any]:
    entries: dict[str, dict[str, Any]] = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, BytesStorageMetadata):
            entries[fqn] = {"bytes": True}
        else:
            p = m.properties
            entries[fqn] = {
                "dtype": p.dtype,
                "requires_grad": p.requires_grad,
                "size": list(m.size),
                "chunks": [[list(c.offsets), list(c.sizes)] for c in m.chunks],
            }
    storage = {_index_key(i): d for i, d in (md.storage_data or {}).items()}
    return {"entries": entries, "storage": storage, "version": md.version}


def _decode_metadata(tree: dict[str, Any]) -> Metadata:
    entries: dict[str, Any] = {}
    for fqn, e in tree["entries"].items():
        if e.get("bytes"):
            entries[fqn] = BytesStorageMetadata()
        else:
            entries[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=e["dtype"], requires_grad=e["requires_grad"]),
                size=torch.Size(e["size"]),
                chunks=[
                    ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                    for o, s in e["chunks"]
                ],
            )
    storage = {}
    for key, data in tree["storage"].items():
        fqn, _, offset = key.rpartition("@")
        # A bytes item has no offset; a tensor's chunk has one per dimension: none for a 0-dim
        # tensor (an optimizer's step), which the key cannot tell from a bytes item's.
        is_tensor = isinstance(entries.get(fqn), TensorStorageMetadata)
        index = MetadataIndex(
            fqn, torch.Size(int(x) for x in offset.split(",") if x) if is_tensor else None
        )
        storage[index] = data
    return Metadata(state_dict_metadata=entries, storage_data=storage, version=tree.get("version"))


class TransomWriter(StorageWriter):
    """DCP StorageWriter: each rank's items go into its checkpoint shard of step `checkpoint_id`
    (not `persist`: memory and peer only, `Engine.save`'s memory-only saves)."""

    def __init__(self, engine: Engine, step: int | None = None, persist: bool = True):
        self.engine = engine
        self.step = step
        self.persist = persist
        self.is_coordinator = False
        self.items: dict[str, Any] = {}
        self.handle: SaveHandle | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | int | None = None) -> None:
        if checkpoint_id is not None:
            self.step = int(str(checkpoint_id))
        self.items = {}
        self.handle = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self.step is None:
            raise CheckpointError("TransomWriter needs a step: pass checkpoint_id=STEP to dcp.save")
        results = []
        for item in plan.items:
            data: Any = planner.resolve_data(item)
            key = _index_key(item.index)
            if item.type == WriteItemType.BYTE_IO:
                value: Any = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data.read())
                size = len(value)
            else:
                value = data.detach()
                size = value.numel() * value.element_size()
            self.items[key] = value
            results.append(
                WriteResult(
                    index=item.index,
                    size_in_bytes=size,
                    storage_data={"rank": self.engine.rank, "key": key},
                )
            )
        if not self.is_coordinator:  # the coordinator saves in finish(), with the global metadata
            self._save(None)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {
            r.index: r.storage_data for rank_results in results for r in rank_results
        }
        if self.is_coordinator:
            self._save(_encode_metadata(metadata))

    def _save(self, metadata: dict[str, Any] | None) -> None:
        assert self.step is not None  # write_data checked it
        state = DcpShard(dcp_items=self.items, dcp_metadata=metadata)  # the planner reshards it
        handle = self.engine.save(self.step, state, persist=self.persist)
        self.handle = handle
        if not handle.ok:
            raise CheckpointError(f"DCP save of step {self.step} refused: {handle.error}")
        self.items = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str] | int) -> bool:
        return isinstance(checkpoint_id, int) or str(checkpoint_id).isdigit()

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.step))


class TransomReader(StorageReader):
    """DCP StorageReader: reads items from the shards of step `checkpoint_id`, any saved rank's."""

    def __init__(self, engine: Engine, step: int | None = None):
        self.engine = engine
        self.step = step
        self.shards: dict[int, dict[str, Any]] = {}
        self.storage_data: dict[MetadataIndex, Any] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | int | None = None) -> None:
        if checkpoint_id is not None:
            self.step = int(str(checkpoint_id))
        self.shards = {}

    def _shard(self, rank: int) -> dict[str, Any]:
        if rank not in self.shards:
            state = self.engine.load(self.step, rank=rank)
            if state is None or "dcp_items" not in state:
                raise CheckpointError(f"step {self.step} rank {rank} is not a DCP checkpoint")
            self.shards[rank] = state
        return self.shards[rank]

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.step is None:
            raise CheckpointError("TransomReader needs a step: pass checkpoint_id=STEP to dcp.load")
        tree = self._shard(0)["dcp_metadata"]
        if tree is None:
            raise CheckpointError(f"step {self.step} rank 0 holds no DCP metadata")
        return _decode_metadata(tree)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            where = self.storage_data[item.storage_index]
            value = self._shard(int(where["rank"]))["dcp_items"][where["key"]]
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(value))
                continue
            source = narrow_tensor_by_index(value, item.storage_offsets, item.lengths)
            target = planner.resolve_tensor(item).detach()
            if target.size() != source.size():
                raise CheckpointError(
                    f"{item.storage_index.fqn}: saved chunk {tuple(source.size())} does not "
                    f"fit {tuple(target.size())}"
                )
            target.copy_(source)
            planner.commit_tensor(item, target)
        self.shards = {}
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str] | int) -> bool:
        return isinstance(checkpoint_id, int) or str(checkpoint_id).isdigit()
