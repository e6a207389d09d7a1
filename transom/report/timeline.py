"""The report's timeline picture (PNG): training progress, faults, detection and recovery spans,
and node membership over one run, on a shared time axis (seconds since the run's first event).

Top panel: the step every rank has finished, one line per generation (a restart or rollback shows
as a drop to the restored step), a red line per fault injection labelled with its type and node,
shaded spans from each injection to its detection and from the detection to training again.
Bottom panel: one lane per node, coloured by its role over time (member, spare, evicted).

Drawn on a bare matplotlib Figure (no pyplot: no display, no global state). This module must
never compute report numbers of its own: it draws what `analysis` computed.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from transom.report.analysis import Generation, kept_steps

FIGURE_WIDTH_IN = 13.0
PROGRESS_HEIGHT_IN = 4.6
LANE_HEIGHT_IN = 0.32
DPI = 110
FAULT_COLOUR = "#c1121f"
DETECTION_COLOUR = "#f4a261"
RECOVERY_COLOUR = "#8ecae6"
ROLE_COLOURS = {"member": "#2a9d8f", "spare": "#b8c0c8", "evicted": "#e76f51"}
GENERATION_COLOURS = matplotlib.color_sequences["tab10"]
LOST_ALPHA = 0.45
FAULT_LABEL_ROWS = 3
OUTCOME_COLOURS = {"SUCCEEDED": "#2a9d8f", "FAILED": "#c1121f"}


def _span(axes, start: float | None, end: float | None, colour: str, origin: float) -> None:
    if start is not None and end is not None and end > start:
        for ax in axes:
            ax.axvspan(start - origin, end - origin, color=colour, alpha=0.35, lw=0, zorder=0)


def draw_timeline(
    path: Path,
    summary: dict,
    gens: list[Generation],
    membership: dict[str, list[tuple[float, float, str]]],
) -> Path:
    """Write the timeline PNG of one run to `path`."""
    origin, end = summary["start_at"], summary["end_at"]
    lanes = list(membership)
    lanes_height_in = 0.8 + LANE_HEIGHT_IN * max(len(lanes), 2)
    fig = Figure(
        figsize=(FIGURE_WIDTH_IN, PROGRESS_HEIGHT_IN + lanes_height_in), layout="constrained"
    )
    top, bottom = fig.subplots(
        2, 1, sharex=True, gridspec_kw={"height_ratios": [PROGRESS_HEIGHT_IN, lanes_height_in]}
    )
    outcome = summary["outcome"]
    goodput = summary["goodput"]
    counts = summary["fault_counts"]
    title = f"{summary.get('job_id') or 'run'}: {outcome['state']} after {goodput['wall_s']:.1f} s"
    details = [f"{counts['recovered']} of {counts['total']} faults detected and recovered"]
    if goodput["effective_ratio_x"] is not None:
        details.append(f"effective training {goodput['effective_ratio_x']:.0%} of wall time")
    if goodput["steps_completed"] is not None:
        details.append(f"{goodput['steps_completed']} steps, {goodput['lost_steps']} lost")
    fig.suptitle(
        f"{title}\n{'; '.join(details)}",
        fontsize=12,
        color=OUTCOME_COLOURS.get(outcome["state"], "black"),
    )

    handles = []
    for i, (g, kept) in enumerate(zip(gens, kept_steps(gens), strict=True)):
        if not g.samples:
            continue
        colour = GENERATION_COLOURS[i % len(GENERATION_COLOURS)]
        kept_points = [(t - origin, s) for t, s in g.samples if s <= kept]
        lost_points = [(t - origin, s) for t, s in g.samples if s >= kept]
        if kept_points and lost_points and kept_points[-1][1] < kept < lost_points[0][1]:
            split = (
                g.time_of_step(kept) - origin,
                kept,
            )  # where the kept steps end, between two samples
            kept_points.append(split)
            lost_points.insert(0, split)
        begins = "fresh" if g.restore_step == 0 else f"from step {g.restore_step}"
        label = f"generation {g.number} ({begins})"
        if kept_points:
            (line,) = top.plot(*zip(*kept_points, strict=True), color=colour, lw=2.2, label=label)
            handles.append(line)
        if len(lost_points) > 1:
            (line,) = top.plot(
                *zip(*lost_points, strict=True),
                color=colour,
                lw=2.2,
                alpha=LOST_ALPHA,
                ls=":",
                label=label,
            )
            handles += [] if kept_points else [line]
        top.plot(*(kept_points or lost_points)[0], "o", color=colour, ms=4)
    if any(k < g.reached_step for g, k in zip(gens, kept_steps(gens), strict=True) if g.samples):
        handles.append(
            Line2D(
                [],
                [],
                color="grey",
                lw=2.2,
                alpha=LOST_ALPHA,
                ls=":",
                label="steps computed again later (lost)",
            )
        )
    if not summary["goodput"]["progress_available"]:
        top.text(
            0.5,
            0.5,
            "no progress.jsonl: training progress unavailable",
            transform=top.transAxes,
            ha="center",
            va="center",
            color="grey",
            fontsize=12,
            zorder=5,
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.9},
        )
        top.set_yticks([])

    for row in summary["faults"]:
        _span((top, bottom), row["injected_at"], row["detected_at"], DETECTION_COLOUR, origin)
        _span((top, bottom), row["detected_at"], row["recovered_at"], RECOVERY_COLOUR, origin)
    for n, row in enumerate(summary["faults"]):
        x = row["injected_at"] - origin
        for ax in (top, bottom):
            ax.axvline(x, color=FAULT_COLOUR, lw=1.2, ls="--", zorder=3)
        where = row["node"] or (f"rank {row['rank']}" if row["rank"] is not None else "")
        near_end = x > 0.85 * (end - origin)
        label = f"{row['type']} {where} " if near_end else f" {row['type']} {where}"
        top.text(
            x,
            1.0 - 0.08 * (n % FAULT_LABEL_ROWS),
            label,
            transform=top.get_xaxis_transform(),
            color=FAULT_COLOUR,
            fontsize=9,
            va="top",
            ha="right" if near_end else "left",
            zorder=4,
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1},
        )
    for ax in (top, bottom):
        ax.axvline(
            end - origin, color=OUTCOME_COLOURS.get(outcome["state"], "black"), lw=1.5, zorder=3
        )
    top.text(
        end - origin,
        0.02,
        f"{outcome['state']} ",
        transform=top.get_xaxis_transform(),
        ha="right",
        va="bottom",
        fontsize=9,
        color=OUTCOME_COLOURS.get(outcome["state"], "black"),
    )

    handles += [
        Line2D([], [], color=FAULT_COLOUR, ls="--", label="fault injected"),
        Patch(color=DETECTION_COLOUR, alpha=0.35, label="detecting (injection to detection)"),
        Patch(color=RECOVERY_COLOUR, alpha=0.35, label="recovering (detection to training again)"),
    ]
    top.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=9, frameon=False
    )
    top.set_ylabel("step finished by every rank")
    top.set_ylim(bottom=0)
    top.grid(alpha=0.3)

    for lane, node in enumerate(lanes):
        for start, stop, role in membership[node]:
            bottom.barh(
                lane,
                stop - start,
                left=start - origin,
                height=0.6,
                color=ROLE_COLOURS[role],
                edgecolor="white",
                lw=0.5,
                zorder=2,
            )
    bottom.set_yticks(range(len(lanes)), lanes)
    bottom.set_ylim(len(lanes) - 0.5 if lanes else 0.5, -0.5)
    bottom.set_xlabel("seconds since the run's first event")
    bottom.set_xlim(0, (end - origin) * 1.01 or 1.0)
    bottom.legend(
        handles=[Patch(color=c, label=r) for r, c in ROLE_COLOURS.items()],
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
        fontsize=9,
        frameon=False,
        title="node role",
        title_fontsize=9,
    )
    bottom.grid(axis="x", alpha=0.3)
    path = Path(path)
    fig.savefig(path, dpi=DPI)
    return path
