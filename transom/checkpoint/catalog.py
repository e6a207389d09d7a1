"""Checkpoint metadata in etcd: which tiers hold which shard, and the newest restorable step.

Keys under the job's prefix (values JSON):
    ckpt/servers/<node>                      a checkpoint server's peer address (under its lease)
    ckpt/flushed/<node>                      a `Flushed`: the server sent what it holds when the
                                             generation's recovery began (the plan waits for it)
    ckpt/discarded                           steps discarded as poisoned: a list of
                                             {first_bad_step, generation}, DISCARDS_KEPT newest
    ckpt/shards/<step:012d>/<rank:06d>/<holder>
        holder "mem-<node>": the shard is in that node's server memory (under the lease of that
                             node's agent, or of a server run on its own: it disappears when
                             the node dies; a server that replaces a dead one under the same
                             agent withdraws them first, `withdraw_memory`)
        holder "storage":    the shard is in the storage directory (survives everything)
        value: a `Listing`: step, rank, tier (a `Tier`: memory or storage), world_size, node,
               nbytes, time, generation (the one that saved the shard: what a discard
               compares), reshardable, and the tier's own: addr and origin, or path

Key names come from transom.common.keys. Only metadata goes here, never shard bytes. Every value
read back goes through `Listing.from_dict`: an entry that is not a valid listing is left out.
Nothing in this module talks to a server.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from transom.checkpoint import reshard_steps
from transom.checkpoint.saved_by import UNKNOWN
from transom.common import keys
from transom.common.record_base import Record, RecordError, parse_all
from transom.common.states import Tier
from transom.store import Store

SHARDS = keys.CKPT_SHARDS
SERVERS = keys.CKPT_SERVERS
FLUSHED = keys.CKPT_FLUSHED
STORAGE_HOLDER = "storage"
shard_key = keys.ckpt_shard
DISCARDS_KEPT = 16


@dataclass
class Listing(Record):
    """A catalog entry: shard (step, rank) held by one tier (its holder is in the key)."""

    step: int
    rank: int
    tier: Tier
    world_size: int | None = None  # of the world that saved it (None: unknown)
    node: str = ""  # the node that listed it
    nbytes: int = 0
    time: float = field(default_factory=time.time)
    generation: int | None = None  # the one that saved the shard (None: unknown)
    reshardable: bool = False  # its header carries a resharding record (reshard_steps)
    addr: str = ""  # memory: the server's peer address
    origin: str = ""  # memory: where the copy came from (budget.Shard.origin)
    path: str = ""  # storage: the file
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def saved_by(self) -> int:
        """The generation that saved the shard, UNKNOWN when the entry does not say."""
        return UNKNOWN if self.generation is None else self.generation


class Discard(NamedTuple):
    """Steps discarded as poisoned: every shard of a step at or after `first_bad_step` saved by
    a generation before `generation` (an abandoned history)."""

    first_bad_step: int
    generation: int

    def to_json(self) -> dict[str, int]:
        return self._asdict()


class MemoryCopy(NamedTuple):
    """A node whose server's memory the catalog lists as holding a shard, and that server's peer
    address (the node is whatever the entry says: a reader that needs an id checks it)."""

    node: str
    addr: str


def memory_copies(entries: dict[str, Listing]) -> list[MemoryCopy]:
    """The copies in server memory among one shard's catalog entries (holder -> entry), in
    holder order; an entry without a node or an address is left out."""
    return [
        MemoryCopy(e.node, e.addr)
        for _, e in sorted(entries.items())
        if e.tier is Tier.MEMORY and e.node and e.addr
    ]


def memory_holder(node: str) -> str:
    """The holder name of a shard in `node`'s server memory."""
    return f"mem-{node}"


def entry(holder: str, listing: Listing) -> tuple[str, dict[str, Any]]:
    """The key and value that list `listing`'s shard as held by `holder`."""
    return shard_key(listing.step, listing.rank, holder), listing.to_dict()


def publish(store: Store, holder: str, listing: Listing, lease: Any = None) -> None:
    store.put(*entry(holder, listing), lease=lease)


def discard_poisoned(store: Store, first_bad_step: int, generation: int) -> list[int]:
    """Forget every shard of a step at or after `first_bad_step` saved by a generation before
    `generation` (an abandoned history: a rolled-back generation's steps after its numerics went
    bad, a bigger world's steps after a shrink's restore step); returns the steps. The discard
    is recorded (`discards`): every server removes those shards from its memory and from
    storage, and never lists them again. Generations, not clocks: the servers' clocks and the
    controller's may differ, generation numbers only grow."""
    mark = Discard(first_bad_step, generation)
    kept = [*discards(store), mark][-DISCARDS_KEPT:]
    store.put(keys.CKPT_DISCARDED, [d.to_json() for d in kept])
    return forget(store, [mark])


def forget(store: Store, marks: list[Discard], steps: list[int] | None = None) -> list[int]:
    """Delete every catalog entry (of `steps` only, if given) that falls under one of the
    discards `marks`; the steps. The controller does it for all steps when it records a
    discard; a server for the steps it removed from storage when it learns of one (an entry
    listed after the controller's sweep, before the server knew, goes too)."""
    found: dict[int, dict[int, dict[str, Listing]]] = {}
    for one in [None] if steps is None else steps:
        found.update(shards(store, one))
    dropped = set()
    for step, ranks in found.items():
        for rank, held in ranks.items():
            for holder, info in held.items():
                if is_discarded(marks, step, info.saved_by):  # the entry names it too
                    store.delete(shard_key(step, rank, holder))
                    dropped.add(step)
    return sorted(dropped)


def discards(store: Store) -> list[Discard]:
    """The recorded discards; malformed entries left out."""
    return parse_discards(store.get(keys.CKPT_DISCARDED))


def parse_discards(value: Any) -> list[Discard]:
    """The discards in a value read from etcd (malformed entries left out; not a list: none)."""
    if not isinstance(value, list):
        return []
    return [
        Discard(d["first_bad_step"], d["generation"])
        for d in value
        if isinstance(d, dict)
        and type(d.get("first_bad_step")) is int
        and type(d.get("generation")) is int
    ]


def is_discarded(marks: list[Discard], step: int, generation: int) -> bool:
    """Whether a shard of `step` saved by `generation` falls under one of the discards `marks`."""
    return any(step >= d.first_bad_step and generation < d.generation for d in marks)


def _keyed(store: Store, step: int | None) -> Iterator[tuple[int, int, str, Any]]:
    """(step, rank, holder, value as read) of every catalog key (of `step` only, if given)
    that parses."""
    prefix = SHARDS if step is None else f"{SHARDS}{step:012d}/"
    for key, value in store.get_prefix(prefix).items():
        parts = (prefix[len(SHARDS) :] + key).split("/")
        if len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit():
            yield int(parts[0]), int(parts[1]), parts[2], value


def _listing(step: int, rank: int, value: Any) -> Listing | None:
    """The listing in a value read from etcd; None when it is not one, or not of the shard its
    key names."""
    try:
        listing = Listing.from_dict(value)
    except RecordError:
        return None
    return listing if (listing.step, listing.rank) == (step, rank) else None


def shards(store: Store, step: int | None = None) -> dict[int, dict[int, dict[str, Listing]]]:
    """step -> rank -> holder -> listing, for every shard some tier holds (of `step` only, if
    given); a key that does not parse, or a value that is not a valid listing, is left out."""
    out: dict[int, dict[int, dict[str, Listing]]] = {}
    for s, rank, holder, value in _keyed(store, step):
        listing = _listing(s, rank, value)
        if listing is not None:
            out.setdefault(s, {}).setdefault(rank, {})[holder] = listing
    return out


def holders(store: Store, step: int, rank: int) -> dict[str, Listing]:
    """holder -> listing of shard (step, rank); values that are not valid listings left out."""
    prefix = f"{SHARDS}{step:012d}/{rank:06d}/"
    found = ((h, _listing(step, rank, v)) for h, v in store.get_prefix(prefix).items())
    return {h: listing for h, listing in found if listing is not None}


def restorable_steps(store: Store, world_size: int, lost: Collection[str] = ()) -> list[int]:
    """Steps whose every rank 0..world_size-1 is held by a live tier, saved with this world size,
    or saved by another world whose every rank's shard is held and reshardable (reshard.py),
    newest first. Memory on a node in `lost` does not count (its lease may not have expired yet),
    nor an entry under a recorded discard (servers list in the background: a listing may land
    after the sweeps of a discard that came meanwhile)."""
    marks = discards(store)

    def live(info: Listing) -> bool:
        if marks and is_discarded(marks, info.step, info.saved_by):
            return False
        return not (info.tier is Tier.MEMORY and info.node in lost)

    entries = [
        (step, rank, info.world_size, info.reshardable)
        for step, ranks in shards(store).items()
        for rank, held in ranks.items()
        for info in held.values()
        if live(info)
    ]
    return sorted(reshard_steps.restorable(entries, world_size), reverse=True)


def newest_restorable(
    store: Store, world_size: int, before: int | None = None, lost: Collection[str] = ()
) -> int | None:
    """The newest restorable step (see `restorable_steps`), strictly below `before` if given."""
    for step in restorable_steps(store, world_size, lost):
        if before is None or step < before:
            return step
    return None


def withdraw_memory(store: Store, node: str) -> int:
    """Withdraw every listing of a shard in `node`'s server memory (a dead server's: its
    successor starts empty, and the agent's lease they live under goes on); how many. It reads
    the whole catalog: for a server's restart, never for every start."""
    holder = memory_holder(node)
    names = [shard_key(s, r, h) for s, r, h, _ in _keyed(store, None) if h == holder]
    store.write_all(dict.fromkeys(names))
    return len(names)


@dataclass
class ServerRecord(Record):
    """A checkpoint server's registration (`ckpt/servers/<node>`): where its peers reach it."""

    node: str
    addr: str


@dataclass
class Flushed(Record):
    """A checkpoint server's word (`ckpt/flushed/<node>`, under its lease) that the catalog holds
    what its memory held when it saw `generation`'s recovery begin: its memory listings wait up
    to LAZY_S otherwise (store/batch_writer.py), and the plan's restore step is read from them."""

    generation: int


def flushed(store: Store) -> dict[str, int]:
    """node -> the newest generation whose recovery its server flushed for (invalid ones left
    out)."""
    return {node: f.generation for node, f in parse_all(Flushed, store.get_prefix(FLUSHED)).items()}


def servers(store: Store) -> dict[str, ServerRecord]:
    """node -> its server's registration; values that are not valid registrations left out."""
    return parse_all(ServerRecord, store.get_prefix(SERVERS))


def register_server(store: Store, node: str, addr: str, lease: Any) -> None:
    """List `node`'s checkpoint server at `addr` for its peers, for as long as `lease` lives."""
    store.put(keys.ckpt_server(node), ServerRecord(node, addr).to_dict(), lease=lease)


def server_addr(store: Store, node: str) -> str | None:
    """The peer address `node`'s checkpoint server registered, None when none (or a bad one)."""
    try:
        addr = ServerRecord.from_dict(store.get(keys.ckpt_server(node))).addr
    except RecordError:
        return None
    return addr or None
