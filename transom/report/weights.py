"""The weights check: is a run's final model bit for bit the model of a fault-free run?

Both files are `torch.save`d state_dicts (nested dicts are flattened to dotted names), loaded
with `weights_only=True` on the CPU. Two tensors are identical when they have the same dtype and
shape and the same bytes (stricter than `torch.equal`, which calls NaN unequal to itself and
-0.0 equal to 0.0). For every other tensor the check says how many elements differ (by their
bytes) and the largest absolute difference.

This module must never modify or re-save either file.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch


def _flatten(state: object, prefix: str = "") -> dict[str, object]:
    if isinstance(state, dict):
        out = {}
        for key, value in state.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: state}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as rows of raw bytes: shape (numel, itemsize)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).reshape(flat.numel(), flat.element_size())


def _number(x: float) -> float | str:
    """JSON has no NaN or infinity: those become the strings "nan" / "inf"."""
    return x if math.isfinite(x) else str(x)


def compare_tensors(name: str, final: object, reference: object) -> dict | None:
    """None when identical, else what differs about this entry."""
    if not (isinstance(final, torch.Tensor) and isinstance(reference, torch.Tensor)):
        if type(final) is type(reference) and final == reference:
            return None
        return {
            "name": name,
            "note": f"{final!r} vs {reference!r}",
            "differing_elements": None,
            "numel": None,
            "max_abs_diff": None,
        }
    if final.dtype != reference.dtype or final.shape != reference.shape:
        return {
            "name": name,
            "note": f"{final.dtype} {tuple(final.shape)} vs {reference.dtype} "
            f"{tuple(reference.shape)}",
            "differing_elements": None,
            "numel": reference.numel(),
            "max_abs_diff": None,
        }
    differ = (_bytes(final) != _bytes(reference)).any(dim=1)
    count = int(differ.sum())
    if count == 0:
        return None
    a = final.detach().cpu().reshape(-1)[differ]
    b = reference.detach().cpu().reshape(-1)[differ]
    if a.is_floating_point() or a.is_complex():
        diff = (
            a.to(torch.complex128 if a.is_complex() else torch.float64)
            - b.to(torch.complex128 if b.is_complex() else torch.float64)
        ).abs()
        largest = math.nan if bool(diff.isnan().any()) else float(diff.max())
    else:
        largest = float((a.to(torch.float64) - b.to(torch.float64)).abs().max())
    return {
        "name": name,
        "note": "",
        "differing_elements": count,
        "numel": reference.numel(),
        "max_abs_diff": _number(largest),
    }


def compare_files(final_path: Path, reference_path: Path) -> dict:
    """{"identical", "tensors", "differing": [...], "missing": [...], "extra": [...]}.

    `missing`: names in the reference but not in the final model; `extra`: the other way round.
    """
    final = _flatten(torch.load(final_path, map_location="cpu", weights_only=True))
    reference = _flatten(torch.load(reference_path, map_location="cpu", weights_only=True))
    differing = [
        d
        for name in sorted(set(final) & set(reference))
        if (d := compare_tensors(name, final[name], reference[name])) is not None
    ]
    missing = sorted(set(reference) - set(final))
    extra = sorted(set(final) - set(reference))
    return {
        "identical": not (differing or missing or extra),
        "tensors": len(reference),
        "differing": differing,
        "missing": missing,
        "extra": extra,
    }
