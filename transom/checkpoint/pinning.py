"""CUDA host registration of the shared-memory regions a worker saves into.

A region registered as pinned memory takes device-to-host copies at full speed and
asynchronously (the engine's save returns while the copy runs). `PinnedRegions` registers a
mapping once and unregisters it before the mapping is closed (it is MappingCache's `release`):
a registration that outlives its mapping keeps the region's pages pinned, so their memory never
goes back to the system, and it refuses a later mapping at the same address.
This module never raises into a save or a load: a failed registration costs speed, not the save.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


class PinnedRegions:
    """The mappings registered with CUDA, by address (True when the registration worked)."""

    def __init__(self) -> None:
        self._registered: dict[int, bool] = {}

    def __len__(self) -> int:
        return sum(self._registered.values())

    def pin(self, data: torch.Tensor) -> None:
        """Register `data`'s memory (a whole mapping) once."""
        address = data.data_ptr()
        if address in self._registered or data.numel() == 0:
            return
        err = torch.cuda.cudart().cudaHostRegister(address, data.numel(), 0)
        if int(err) != 0:
            log.warning("cudaHostRegister failed (%s): device-to-host copies will be slower", err)
        self._registered[address] = int(err) == 0

    def release(self, data: torch.Tensor) -> None:
        """Before `data`'s mapping is closed: wait for the copies into it, then unregister it."""
        if not self._registered.pop(data.data_ptr(), False):
            return
        try:
            torch.cuda.synchronize()
            err = torch.cuda.cudart().cudaHostUnregister(data.data_ptr())
        except RuntimeError as e:  # the device failed: the process's pins end with it
            log.warning("could not unregister a pinned checkpoint region: %s", e)
            return
        if int(err) != 0:
            log.warning("cudaHostUnregister failed (%s)", err)
