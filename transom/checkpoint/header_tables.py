"""A save's tensor and storage tables go to the node's server once per connection, not with
every save.

A save every step sends the same tables every step (flatten.py keeps them while a state's
tensors view the same memory): two thirds of the demo model's 16 KB header, encoded by the
worker and parsed by the server each step. flatten.py numbers each set of tables
(`Plan.tables`); a commit names that number, and carries the tables only the first time
(`WorkerTables`). The server keeps the last KEPT sets each connection sent (`ConnectionTables`)
and puts them back into the header before anything reads it. A commit that names tables its
connection was never sent (the worker's connection was made anew, or the server forgot them) is
refused with UNKNOWN_TABLES, before its region is touched, and the worker sends it in full.
A commit sent without waiting for its reply (`WorkerTables.send`: a save every step) that is
refused so is kept, and sent in full, waiting, by `resend`: the reader of a reply may not make
a request.

This module never reads or checks what a header's tables say: `ShardHeader.from_json` does
(shard_header.py), on the header put back together as the worker planned it, before the server
takes the commit.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from transom.checkpoint.client import CheckpointError, ServerConnection
from transom.checkpoint.shard_header import ShardError, ShardHeader
from transom.checkpoint.worker_protocol import Commit, Done, Failed

TABLE_KEYS = ("tensors", "storages")
# Sets of tables kept for a connection (a process may save a few states in turn).
KEPT = 4
UNKNOWN_TABLES = "the commit names tables this connection was never sent"
# What gets a commit's reply, or the error that stands for it.
Answered = Callable[[Done | Failed | CheckpointError], None]


class WorkerTables:
    """The worker's side: which numbered tables its server connection was sent."""

    def __init__(self) -> None:
        self._sent: OrderedDict[int, None] = OrderedDict()
        # Commits `send` wrote whose server lacked their tables: for `resend`, with their receiver.
        self._refused: deque[tuple[Commit, Answered]] = deque()

    def send(self, connection: ServerConnection, request: Commit, on_reply: Answered) -> None:
        """Write `request` without waiting for its reply, which `on_reply` gets when it is read
        (`ServerConnection.send`), or after `resend` when the server turns out to lack the
        tables; its tables left out once the server has taken them."""
        number = request.tables
        if number is None or number not in self._sent:

            def answered_in_full(reply: Done | Failed | CheckpointError) -> None:
                if number is not None and isinstance(reply, Done):
                    self._taken(number)
                on_reply(reply)

            connection.send(request, answered_in_full)
            return

        def answered(reply: Done | Failed | CheckpointError) -> None:
            if isinstance(reply, Failed) and reply.error.startswith(UNKNOWN_TABLES):
                self._sent.pop(number, None)
                self._refused.append((request, on_reply))
                return
            on_reply(reply)

        header = {k: v for k, v in request.header.items() if k not in TABLE_KEYS}
        connection.send(dataclasses.replace(request, header=header), answered)

    def resend(self, connection: ServerConnection) -> None:
        """Send in full, waiting for the reply, each commit `send` wrote whose server lacked
        its tables (its region is still reserved: the server refused it before touching it)."""
        while self._refused:
            request, on_reply = self._refused.popleft()
            try:
                reply: Done | Failed | CheckpointError = self.commit(connection, request)
            except CheckpointError as e:
                reply = e
            on_reply(reply)

    def commit(self, connection: ServerConnection, request: Commit) -> Done | Failed:
        """`request`'s reply, its tables left out when the server has them (sent in full when it
        turns out not to); CheckpointError as `connection.request` raises it."""
        number = request.tables
        if number is not None and number in self._sent:
            header = {k: v for k, v in request.header.items() if k not in TABLE_KEYS}
            reply = connection.request(dataclasses.replace(request, header=header))
            if not (isinstance(reply, Failed) and reply.error.startswith(UNKNOWN_TABLES)):
                return reply
            self._sent.pop(number, None)
        reply = connection.request(request)
        if number is not None and isinstance(reply, Done):
            self._taken(number)
        return reply

    def _taken(self, number: int) -> None:
        """The server took tables `number` (it keeps the last KEPT)."""
        self._sent[number] = None
        self._sent.move_to_end(number)
        while len(self._sent) > KEPT:
            self._sent.popitem(last=False)


class ConnectionTables:
    """The server's side: the tables one worker connection sent, by number."""

    def __init__(self) -> None:
        self._kept: OrderedDict[int, dict[str, Any]] = OrderedDict()

    def header(self, request: Commit) -> ShardHeader:
        """`request`'s header with its tables (kept now when it carries them), read and checked
        (`ShardHeader.from_json`: ShardError for a malformed one, or one of another step or rank
        than the commit's); ValueError (UNKNOWN_TABLES) when it names tables this connection
        never sent."""
        return _checked(request, self._complete(request))

    def _complete(self, request: Commit) -> dict[str, Any]:
        number, header = request.tables, request.header
        if number is None:
            return header
        if all(k in header for k in TABLE_KEYS):
            self._kept[number] = {k: header[k] for k in TABLE_KEYS}
            self._kept.move_to_end(number)
            while len(self._kept) > KEPT:
                self._kept.popitem(last=False)
            return header
        tables = self._kept.get(number)
        if tables is None:
            raise ValueError(f"{UNKNOWN_TABLES} ({number})")
        return {**header, **tables}


def _checked(request: Commit, fields: dict[str, Any]) -> ShardHeader:
    header = ShardHeader.from_json(fields)
    if (header.step, header.rank) != (request.step, request.rank):
        raise ShardError(
            f"commit of step {request.step} rank {request.rank} carries the header of step "
            f"{header.step} rank {header.rank}"
        )
    return header
