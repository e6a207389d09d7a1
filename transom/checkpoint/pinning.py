"""CUDA host registration of the shared-memory regions a worker saves into.

A region registered as pinned memory takes device-to-host copies at full speed and
asynchronously (the engine's save returns while the copy runs). `PinnedRegions` registers a
mapping once and unregisters it before the mapping is closed (it is MappingCache's `release`),
after the copies into it have ended: a registration that outlives its mapping makes CUDA take
later memory at that address for registered memory (on an H200 the process's next ordinary
`tensor.cpu()` failed with "CUDA error: invalid argument").
This module never raises into a save or a load: a failed registration costs speed, not the save.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)


# cudaHostRegisterPortable: pinned for every device's context, not only the current device's
# (a worker whose tensors live on another GPU than its current one copies from there).
REGISTER_PORTABLE = 1


class PinnedRegions:
    """The mappings registered with CUDA, by address (True when the registration worked), and
    the events that end the newest copy into each."""

    def __init__(self) -> None:
        self._registered: dict[int, bool] = {}
        self._copies: dict[int, list[torch.cuda.Event]] = {}

    def __len__(self) -> int:
        return sum(self._registered.values())

    def pin(self, data: torch.Tensor) -> None:
        """Register `data`'s memory (a whole mapping) once."""
        address = data.data_ptr()
        if address in self._registered or data.numel() == 0:
            return
        err = _cudart().cudaHostRegister(address, data.numel(), REGISTER_PORTABLE)
        if int(err) != 0:
            log.warning("cudaHostRegister failed (%s): device-to-host copies will be slower", err)
        self._registered[address] = int(err) == 0

    def copying(self, data: torch.Tensor, done: list[torch.cuda.Event]) -> None:
        """Copies into `data`'s mapping end with `done` (one event per source device)."""
        self._copies[data.data_ptr()] = done

    def release(self, data: torch.Tensor) -> None:
        """Before `data`'s mapping is closed: wait for the copies into it, then unregister it."""
        address = data.data_ptr()
        done = self._copies.pop(address, [])
        if not self._registered.pop(address, False):
            return
        try:
            for event in done:
                event.synchronize()
            err = _cudart().cudaHostUnregister(address)
        except RuntimeError as e:  # the device failed: the process's pins end with it
            log.warning("could not unregister a pinned checkpoint region: %s", e)
            return
        if int(err) != 0:
            log.warning("cudaHostUnregister failed (%s)", err)


def _cudart() -> Any:
    """torch's bindings of the CUDA runtime (torch declares no types for them)."""
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]
