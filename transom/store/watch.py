"""`PrefixWatch`: every change under one of a job's key names, pushed by etcd instead of polled.

A watch reads the prefix once (`start()` returns the values and the revision they were read
at) and then follows etcd's v3 HTTP gateway stream (`POST /v3/watch`) from the next revision.
Its one thread hands the changes to the caller as `Update`s, in revision order, through a
bounded queue (`get`), or, given `on_update`, by calling it from the watch's thread (no second
thread woken per change: for a caller that only files the change away, as the controller's view
of a thousand nodes' summaries does):
  - `events`: puts and deletes, each with its revision; a transaction's writes come together;
  - `snapshot`: when etcd has compacted the revisions the watch would resume from, it cannot
    replay them; the watch reads the whole prefix again and hands over that full view instead
    (the caller replaces what it knows with it), then follows on from there.
After a disconnect (etcd restarted, a network cut) the thread reconnects, with a backoff, and
resumes from the revision after the last one it delivered, so no change is lost or delivered
twice. A caller that knows the way to etcd was cut (a stream's TCP connection can stay open
and silent through a network cut) calls `reconnect()`: the stream is dropped and resumed the
same way. `stop()` ends the stream and the thread within a bounded time.

It only reads; it must never write to etcd, and it never raises into the caller's thread from
its own (a failure to reach etcd is retried; `healthy` says whether the stream is up now).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import queue
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import requests

from transom.store.etcd_client import Store

log = logging.getLogger(__name__)

QUEUE_SIZE = 1024  # updates not yet taken by the caller; the stream waits while it is full
BACKOFF_S = (0.05, 2.0)  # first and longest wait before a reconnection
CONNECT_TIMEOUT_S = 5.0
# etcd answers a watch request at once (headers, then "created"); no answer in this long means
# the way to it is cut. Once the stream is up it may stay quiet for as long as nothing changes.
ANSWER_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class WatchEvent:
    """One put or delete of a key under the watched name."""

    name: str  # the key, less the job's prefix and the watched name
    deleted: bool
    value: Any | None  # the JSON value of a put; None for a delete or a value that is not JSON
    revision: int


@dataclass(frozen=True)
class Update:
    """What the watch hands over: events in revision order, or a full re-read."""

    revision: int  # every change up to this revision is in this update or an earlier one
    events: tuple[WatchEvent, ...] = ()
    snapshot: dict[str, Any] | None = field(default=None)  # set: replace your view with this


_WAKE = Update(revision=-1)  # put by `wake`: `get` returns None for it, never hands it over


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text or "")


def _prefix_end(prefix: str) -> str:
    """etcd's range end for `prefix`: the prefix with its last byte incremented."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1  # job prefixes end in "/", never in 0xff
    return base64.b64encode(bytes(raw)).decode()


def _json_or_none(raw: bytes) -> Any | None:
    try:
        return json.loads(raw)
    except ValueError:
        return None


class Compacted(Exception):
    """etcd no longer has the revision the watch would resume from."""


class PrefixWatch:
    """Watch every key under `store.key(name)` (e.g. keys.NODES, or keys.PLAN for one key)."""

    def __init__(
        self,
        store: Store,
        name: str,
        queue_size: int = QUEUE_SIZE,
        on_update: Callable[[Update], None] | None = None,
    ):
        # A client of its own (the stream holds a connection for as long as it runs), with the
        # caller's limits: a direct read gives up when the caller's own requests would.
        policy = store.policy
        self.store = Store(
            store.access,
            store.job_id,
            timeout=policy.request_timeout_s,
            deadline_s=policy.deadline_s,
        )
        self.name = name
        self.start_key = store.key(name)
        self.updates: queue.Queue[Update] = queue.Queue(maxsize=queue_size)
        self.on_update = on_update  # set: called with each update instead of queueing it
        self.revision = 0  # the newest revision delivered
        self.healthy = False
        self.reconnects = 0
        self._stopping = threading.Event()
        self._response: requests.Response | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"watch-{name}", daemon=True)

    # -- the caller's side ---------------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        """The values under the name now (keyed by the rest of their key); changes after them
        arrive through `get`, or `on_update`, which is first handed these values as a snapshot
        (so no change can reach it before them). StoreError if etcd cannot be read."""
        values, revision = self.read()
        if self.on_update is not None:
            self._deliver(Update(revision=revision, snapshot=values))
        self.follow(revision)
        return values

    def follow(self, revision: int) -> None:
        """Deliver the changes after `revision` (one the caller read at, or saved), without
        reading first; if etcd has compacted it away, the first update is a snapshot."""
        self.revision = revision
        self._thread.start()

    def get(self, timeout: float | None = None) -> Update | None:
        """The next update, or None if none came within `timeout` seconds (or `wake` was
        called)."""
        try:
            update = self.updates.get(timeout=timeout)
            while update is _WAKE:  # woken: an update queued behind it, else none
                update = self.updates.get_nowait()
        except queue.Empty:
            return None
        return update

    def wake(self) -> None:
        """Make a `get` waiting now (or the next one) return None at once; from any thread."""
        with contextlib.suppress(queue.Full):  # full: `get` returns at once anyway
            self.updates.put_nowait(_WAKE)

    def reconnect(self) -> None:
        """Drop the stream now; the thread resumes from the revision after the last one it
        delivered (nothing lost, nothing twice)."""
        self._close_stream()

    def stop(self) -> None:
        """End the stream and the thread (within STOP_TIMEOUT_S)."""
        self._stopping.set()
        self._close_stream()
        if self._thread.is_alive():
            self._thread.join(STOP_TIMEOUT_S)

    def __enter__(self) -> PrefixWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- reading -------------------------------------------------------------------------------
    def read(self) -> tuple[dict[str, Any], int]:
        """All values under the name and the revision they were read at (one range request)."""
        client = self.store.client
        request = {"key": _b64(self.start_key), "range_end": _prefix_end(self.start_key)}
        reply = self.store._call(client.post, client.get_url("/kv/range"), json=request)
        values = {}
        for kv in reply.get("kvs", []):
            name = _unb64(kv.get("key")).decode(errors="replace")[len(self.start_key) :]
            values[name] = _json_or_none(_unb64(kv.get("value")))
        return values, int(reply["header"]["revision"])

    # -- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        wait = BACKOFF_S[0]
        while not self._stopping.is_set():
            try:
                self._follow()
                wait = BACKOFF_S[0]  # the stream ended after working: reconnect at once
            except Compacted:
                self._resync()
                continue
            except Exception as e:  # noqa: BLE001 - any failure: reconnect and resume
                if self._stopping.is_set():
                    break
                log.info("watch on %s: %s; resuming from revision %d", self.name, e,
                         self.revision + 1)  # fmt: skip
            finally:
                self.healthy = False
            self.reconnects += 1
            if self._stopping.wait(wait):
                break
            wait = min(BACKOFF_S[1], wait * 2)

    def _resync(self) -> None:
        """Re-read everything after a compaction and hand it over as a snapshot."""
        try:
            values, revision = self.read()
        except Exception as e:  # noqa: BLE001 - the next stream finds the compaction again
            log.info("watch on %s: re-read failed: %s", self.name, e)
            self._stopping.wait(BACKOFF_S[1])
            return
        self.revision = revision
        self._deliver(Update(revision=revision, snapshot=values))

    def _follow(self) -> None:
        """One watch stream from self.revision + 1 until it ends or fails."""
        client = self.store.client
        request: dict[str, Any] = {
            "create_request": {
                "key": _b64(self.start_key),
                "range_end": _prefix_end(self.start_key),
                "start_revision": self.revision + 1,
                "progress_notify": True,
            }
        }
        response = client.session.post(
            client.get_url("/watch"),
            json=request,
            stream=True,
            timeout=(CONNECT_TIMEOUT_S, ANSWER_TIMEOUT_S),
        )
        sock = _socket_of(response)
        if sock is not None:
            sock.settimeout(None)  # answered: from now on quiet only means nothing changed
        with self._lock:
            self._response = response
        if self._stopping.is_set():
            self._close_stream()
        try:
            if response.status_code != 200:
                raise RuntimeError(f"etcd answered the watch with HTTP {response.status_code}")
            pending = b""
            for chunk in response.iter_content(chunk_size=None):  # as it arrives
                if self._stopping.is_set():
                    return
                pending += chunk
                *lines, pending = pending.split(b"\n")  # one JSON message a line
                for line in lines:
                    if line.strip():
                        self._handle(json.loads(line))
            raise ConnectionError("the watch stream ended")
        finally:
            self._close_stream()

    def _handle(self, message: dict[str, Any]) -> None:
        if "error" in message:
            raise RuntimeError(f"watch error: {message['error']}")
        result = message.get("result", {})
        if int(result.get("compact_revision", 0) or 0) > 0:
            raise Compacted()
        if result.get("canceled"):
            raise RuntimeError(f"etcd canceled the watch: {result.get('cancel_reason', '')}")
        if result.get("created"):
            self.healthy = True
            return
        events = []
        for raw in result.get("events", []):
            kv = raw.get("kv", {})
            revision = int(kv.get("mod_revision", 0))
            if revision <= self.revision:  # already delivered (cannot happen; never twice)
                continue
            deleted = raw.get("type") == "DELETE"
            name = _unb64(kv.get("key")).decode(errors="replace")[len(self.start_key) :]
            value = None if deleted else _json_or_none(_unb64(kv.get("value")))
            events.append(WatchEvent(name, deleted, value, revision))
        if events:
            self._deliver(Update(revision=events[-1].revision, events=tuple(events)))
            self.revision = events[-1].revision
        elif not result.get("events"):  # a progress notification: nothing up to here missed
            header_revision = int(result.get("header", {}).get("revision", 0))
            self.revision = max(self.revision, header_revision)

    def _deliver(self, update: Update) -> None:
        """Hand `update` to `on_update`, or queue it, waiting while the caller is behind (never
        dropping it)."""
        if self.on_update is not None:
            try:
                self.on_update(update)
            except Exception:  # noqa: BLE001 - the caller's bug must not end the stream
                log.exception("watch on %s: the caller failed to take an update", self.name)
            return
        while not self._stopping.is_set():
            try:
                self.updates.put(update, timeout=0.2)
                return
            except queue.Full:
                continue

    def _close_stream(self) -> None:
        """Wake a read blocked on the stream: shut its socket down, then close it."""
        with self._lock:
            response, self._response = self._response, None
        if response is None:
            return
        try:
            sock = _socket_of(response)
            if sock is not None:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        response.close()


def _socket_of(response: requests.Response) -> socket.socket | None:
    """The socket a streamed response reads from (urllib3 2.x), if it can be found."""
    return getattr(getattr(response.raw, "_connection", None), "sock", None)
