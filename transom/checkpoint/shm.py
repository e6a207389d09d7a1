"""Shared-memory regions: files under /dev/shm that a worker and its node's checkpoint server map.

Touching a fresh shared mapping for the first time costs about 2 s per GiB in page faults, more
than writing the bytes; a region is therefore created populated (MAP_POPULATE) once, ahead of the
save that uses it, and then reused by later saves of the same size. A region's pages are
allocated up front (posix_fallocate) before it is mapped: a full /dev/shm is an OSError when the
region is created (a refused save), never a SIGBUS in the middle of a copy. Workers keep their
mappings open across saves (`MappingCache`), so a steady-state save is a plain memory copy.

A region a worker has loaded from is mapped copy-on-write (MAP_PRIVATE): the worker may change
the loaded tensors without touching the checkpoint. Such a region is "loaned" and never written
again by the server (it is unlinked when evicted), so the worker's views stay valid as long as
it keeps them. This module never decides what to keep (that is the server's job) and never
imports torch (the server maps regions without it; a worker's tensor views are layout.as_bytes).
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from transom.checkpoint.shm_dirs import claim

FileIdentity = tuple[int, int]  # (st_dev, st_ino)
View = TypeVar("View")


def populated_map(
    path: Path, nbytes: int, private: bool = False, create: bool = False
) -> mmap.mmap:
    """Map `path` (creating it with `nbytes` when `create`).

    A shared mapping has every page faulted in up front (MAP_POPULATE), ready for copies into it.
    A private (copy-on-write) mapping is for reading: populating it would copy every page (the
    kernel prefaults writable private pages for writing), so its pages fault in on first read
    (checksum verification touches them all, on several threads).
    """
    return mapped_file(path, nbytes, private, create)[0]


def mapped_file(
    path: Path, nbytes: int, private: bool = False, create: bool = False
) -> tuple[mmap.mmap, FileIdentity]:
    """`populated_map`, with the identity of the very file it mapped."""
    flags = mmap.MAP_PRIVATE if private else mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            allocate(fd, nbytes, path)
        elif os.fstat(fd).st_size < nbytes:
            raise OSError(f"shared-memory region {path} is smaller than {nbytes} bytes")
        st = os.fstat(fd)
        m = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        return m, (st.st_dev, st.st_ino)
    finally:
        os.close(fd)


def file_identity(path: str | Path) -> FileIdentity | None:
    """(device, inode) of the file now at `path`; None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def allocate(fd: int, nbytes: int, path: Path) -> None:
    """Give the file `fd` `nbytes` of real pages now (ENOSPC now rather than SIGBUS later); the
    file is removed again when they cannot all be had."""
    try:
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS):  # no fallocate here: a sparse file
            os.ftruncate(fd, nbytes)
            return
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        free = shutil.disk_usage(path.parent).free if path.parent.exists() else 0
        raise OSError(
            e.errno,
            f"cannot allocate a shared-memory region of {nbytes} bytes in {path.parent} "
            f"({free} bytes free there): {e.strerror}",
        ) from e


def anonymous_buffer(nbytes: int) -> mmap.mmap:
    """Private memory for a shard read from a peer or from disk, on huge pages where the kernel
    allows."""
    m = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return m


class Region:
    """One region file owned by the checkpoint server."""

    def __init__(self, path: Path, nbytes: int):
        self.path = Path(path)
        self.nbytes = nbytes
        self.loaned = False  # a worker mapped it for loading: never write into it again
        self.prepared_for: int | None = (
            None  # the rank whose next save gets it (its worker mapped it)
        )
        self.map = populated_map(self.path, nbytes, create=True) if nbytes else None

    @property
    def name(self) -> str:
        return self.path.name

    def view(self) -> memoryview:
        return memoryview(self.map) if self.map is not None else memoryview(b"")

    def destroy(self) -> None:
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:
                pass  # a view is still exported; the mapping goes when it is collected
            self.map = None
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


class RegionDir:
    """The folder of one server's regions: created empty and owned by this process (a dead
    owner's leftovers removed; a live owner's folder is never taken: OwnedBySomeoneElse)."""

    def __init__(self, path: Path, job_id: str = "", node_id: str = ""):
        self.path = Path(path)
        claim(self.path, job_id, node_id)
        self._lock = threading.Lock()
        self._next = 0

    def new(self, nbytes: int) -> Region:
        """A new region, named uniquely to this process: a server started again in the same
        folder never reuses a name a worker may still have mapped (MappingCache)."""
        with self._lock:
            self._next += 1
            name = f"r{os.getpid()}-{self._next:06d}-{nbytes}"
        return Region(self.path / name, nbytes)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class MappingCache(Generic[View]):
    """A worker's open mappings of server regions, by path, so repeated saves skip mapping;
    each with the view `as_view` made of it once (the engine's: a uint8 tensor, layout.as_bytes).

    A mapping is reused only while the file at its path is the very file it maps (same device
    and inode): a region deleted and a new one created under the same path (a server started
    again) must never receive a save through the old mapping, whose bytes no one reads.
    `release(view)` runs before a mapping is closed (the engine unregisters a pinned one there)."""

    def __init__(
        self,
        as_view: Callable[[mmap.mmap], View],
        limit: int = 8,
        release: Callable[[View], None] | None = None,
    ):
        self.as_view = as_view
        self.limit = limit
        self.release = release
        self._maps: dict[str, tuple[mmap.mmap, View, FileIdentity]] = {}
        # A save's thread and the thread mapping the next save's region (next_region.py).
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._maps)

    def get(self, path: str, nbytes: int) -> View:
        with self._lock:
            hit = self._maps.get(path)
            if hit is not None and len(hit[0]) == nbytes and hit[2] == file_identity(path):
                return hit[1]
            self.drop(path)
            if len(self._maps) >= self.limit:
                self.drop(next(iter(self._maps)))
            m, identity = mapped_file(Path(path), nbytes)
            view = self.as_view(m)
            self._maps[path] = (m, view, identity)
            return view

    def drop(self, path: str) -> None:
        with self._lock:
            hit = self._maps.pop(path, None)
        if hit is not None:
            m, view, _ = hit
            if self.release is not None:
                self.release(view)
            del view
            try:
                m.close()
            except BufferError:
                pass

    def drop_missing(self) -> list[str]:
        """Unmap every region whose file is gone (the server deleted it) or is another file now
        (a new server's region under the same path); the paths dropped."""
        with self._lock:
            gone = [path for path, hit in self._maps.items() if file_identity(path) != hit[2]]
            for path in gone:
                self.drop(path)
        return gone

    def clear(self) -> None:
        with self._lock:
            for path in list(self._maps):
                self.drop(path)
