"""Who was in the job when: per node, the spans it was a member, a spare or evicted.

Computed from the decision log (generation, evict and spare events) and the launcher's progress
samples (their member lists), for the report's timeline. Pure: it never reads files or draws.
"""

from __future__ import annotations

from transom.common.names import natural_key
from transom.common.records import Event, EventKind


def membership(
    events: list[Event], progress: list[dict] | None, end: float
) -> dict[str, list[tuple[float, float, str]]]:
    """Per node, (from, to, role) spans with role member | spare | evicted, from the generation,
    evict and spare events and the progress samples' member lists."""
    changes: list[tuple[float, dict[str, str | None]]] = []
    for e in events:
        if e.kind == EventKind.GENERATION:
            changes.append(
                (
                    e.time,
                    {
                        **{n: "member" for n in e.members or []},
                        **{n: "spare" for n in e.spares or []},
                        "*": None,
                    },
                )
            )
        elif e.kind == EventKind.EVICT and e.node:
            changes.append((e.time, {e.node: "evicted"}))
        elif e.kind == EventKind.SPARE and e.node:
            changes.append((e.time, {e.node: "member"}))
    for p in progress or []:
        if p.get("members") is not None:
            evicted = p.get("evicted") or []
            changes.append(
                (
                    p["time"],
                    {
                        **{n: "member" for n in p["members"]},
                        **{n: "spare" for n in p.get("spares") or []},
                        **{n: "evicted" for n in evicted},
                        "*": None,
                    },
                )
            )
    changes.sort(key=lambda c: c[0])
    role: dict[str, str] = {}
    spans: dict[str, list[list]] = {}
    for t, change in changes:
        full = "*" in change
        new = dict(role)
        if (
            full
        ):  # a full snapshot: members and spares not named are out of the job (unless evicted)
            for n, r in role.items():
                if r != "evicted" and n not in change:
                    new.pop(n)
        new.update({n: r for n, r in change.items() if n != "*" and r is not None})
        for n in set(role) | set(new):
            if role.get(n) != new.get(n):
                if role.get(n) is not None:
                    spans[n][-1][1] = t
                if new.get(n) is not None:
                    spans.setdefault(n, []).append([t, None, new[n]])
        role = new
    for n in role:
        spans[n][-1][1] = end
    return {n: [tuple(s) for s in spans[n]] for n in sorted(spans, key=natural_key)}
