"""The report's markdown: the summary dict written out for a person (`report.md`, and what
`transom report` prints).

This module must never compute a number itself: every figure comes from the summary dict, so the
markdown and `report.json` always agree.
"""

from __future__ import annotations

from transom.common import files

DEFINITIONS = """\
**How to read these numbers.** Wall time runs from the run's first event to its final
(succeeded/failed) event. A generation restores step r (0 when fresh) and *trains again* at its
first progress sample beyond r; a sample's step is the newest step every rank has finished.
*Effective training time* is the time spent computing the steps that are in the final model: for
each generation, from training again to the moment it finished the last step no later generation
computed again (step times between samples are interpolated). The rest of the wall time is
start-up (until the first generation trains), lost compute (steps that were computed again later),
downtime (from a generation's last step to the next generation training again: detection, restart,
restore, first step) and shutdown (after the last step). *Lost steps* sum, over incidents, the step
reached when training was interrupted minus the step the next generation restored. Per fault,
*detection* runs from the injection to the first event that detected it (with the step that event
names, if any: a fingerprint's step counts the optimizer's steps from 0), *recovery* from the
detection to the next generation training again."""


def _s(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f} s"


def _at(value: float | None, origin: float) -> str:
    return "n/a" if value is None else f"+{value - origin:.1f} s"


def _cell(value: object) -> str:
    return "n/a" if value is None else str(value).replace("|", "\\|").replace("\n", " ")


def _goodput(g: dict) -> list[str]:
    wall = g["wall_s"]

    def share(seconds: float | None) -> str:
        if seconds is None:
            return "n/a"
        return f"{seconds:.1f} s ({seconds / wall:.0%})" if wall > 0 else f"{seconds:.1f} s"

    lines = ["| measure | value |", "|---|---|", f"| wall time | {_s(wall)} |"]
    if not g["progress_available"]:
        lines.append(
            "| steps, effective training time, lost steps "
            f"| unavailable: the run has no {files.PROGRESS} |"
        )
    else:
        lines += [
            f"| steps completed (final step) | {g['steps_completed']} |",
            f"| effective training time | {share(g['effective_training_s'])} |",
            f"| effective-training-time ratio | {g['effective_ratio_x']:.3f} |"
            if g["effective_ratio_x"] is not None
            else "| effective-training-time ratio | n/a |",
            f"| start-up | {share(g['startup_s'])} |",
            f"| downtime (detection + recovery) | {share(g['downtime_s'])} |",
            f"| lost compute (re-computed steps) | {share(g['lost_compute_s'])} |",
            f"| shutdown | {share(g['shutdown_s'])} |",
            f"| lost steps in total | {g['lost_steps']} |",
        ]
    if g["reference_wall_s"] is not None:
        lines += [
            f"| fault-free reference run | {_s(g['reference_wall_s'])} |",
            f"| slowdown against it | {g['slowdown_x']:.2f}x |",
        ]
    else:
        lines.append("| fault-free reference run | unavailable: no reference.json |")
    return lines


def _faults(rows: list[dict], origin: float) -> list[str]:
    if not rows:
        return ["No faults were injected."]
    lines = [
        (
            "| fault | type | node / rank | step | injected | detected by | detection | "
            "recovered (generation, running, training) | recovery | lost steps | status |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        where = f"{r['node'] or '?'} / {r['rank'] if r['rank'] is not None else '?'}"
        recovered = (
            "n/a"
            if r["recovered_at"] is None
            else (
                f"g{r['recovered_in_generation']}, {_at(r['running_at'], origin)}, "
                f"{_at(r['recovered_at'], origin)}"
            )
        )
        cells = [
            _cell(r["id"]),
            r["type"],
            where,
            _cell(r["step"]),
            _at(r["injected_at"], origin),
            _cell(r["detected_by"])
            + (f" (step {r['detected_step']})" if r.get("detected_step") is not None else ""),
            _s(r["detection_s"], 2),
            recovered,
            _s(r["recovery_s"], 2),
            _cell(r["lost_steps"]),
            r["status"],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _incidents(summary: dict, origin: float) -> list[str]:
    gens = summary["generations"]
    if not gens:
        return ["The job never started a generation."]
    lines = [
        "| generation | started | members | spares | restored step | reached step | trains again |",
        "|---|---|---|---|---|---|---|",
    ]
    for g in gens:
        lines.append(
            f"| {g['generation']} | {_at(g['started_at'], origin)} | {', '.join(g['members'])} | "
            f"{', '.join(g['spares']) or '-'} | {g['restore_step']} | {_cell(g['reached_step'])} | "
            f"{_at(g['trained_at'], origin)} |"
        )
    causes = [
        f"- generation {i['generation']} -> {i['next_generation']}: {i['cause'] or 'unknown cause'}"
        + (
            f" ({i['lost_steps']} steps lost: reached {i['interrupted_step']}, "
            f"restored {i['restore_step']})"
            if i["lost_steps"] is not None
            else ""
        )
        for i in summary["incidents"]
    ]
    return lines + ([""] + causes if causes else [])


def _weights(w: dict) -> list[str]:
    if not w["available"]:
        return [f"Unavailable: {w['note']}."]
    if w["identical"]:
        return [
            (
                f"**Bit-identical**: all {w['tensors']} tensors of the final model equal the "
                "fault-free run's, byte for byte."
            )
        ]
    lines = [f"**Not identical**: {len(w['differing'])} of {w['tensors']} tensors differ."]
    if w["differing"]:
        lines += ["", "| tensor | differing elements | max abs diff | note |", "|---|---|---|---|"]
        for d in w["differing"]:
            count = (
                "n/a"
                if d["differing_elements"] is None
                else f"{d['differing_elements']} of {d['numel']}"
            )
            diff = (
                "n/a"
                if d["max_abs_diff"] is None
                else (
                    d["max_abs_diff"]
                    if isinstance(d["max_abs_diff"], str)
                    else f"{d['max_abs_diff']:.3g}"
                )
            )
            lines.append(f"| {_cell(d['name'])} | {count} | {diff} | {_cell(d['note']) or ''} |")
    if w["missing"]:
        lines += ["", f"Missing from the final model: {', '.join(w['missing'])}."]
    if w["extra"]:
        lines += ["", f"Only in the final model: {', '.join(w['extra'])}."]
    return lines


def render_markdown(summary: dict, png_name: str | None = "report.png") -> str:
    """The whole report as markdown."""
    origin = summary["start_at"]
    outcome, counts = summary["outcome"], summary["fault_counts"]
    head = [
        f"# Transom run report: {summary.get('job_id') or summary['run_dir']}",
        "",
        (
            f"**Outcome: {outcome['state']}** ({_cell(outcome['reason'])}). "
            f"{outcome['generations']} generation(s), {outcome['restarts']} restart(s); "
            f"{counts['recovered']} of {counts['total']} faults detected and recovered, "
            f"{counts['not_recovered']} detected but not recovered, "
            f"{counts['not_detected']} not detected."
        ),
        "",
    ]
    if png_name:
        head += [f"![timeline]({png_name})", ""]
    if summary["unavailable"]:
        head += ["Unavailable in this run: " + "; ".join(summary["unavailable"]) + ".", ""]
    parts = (
        head
        + ["## Goodput", ""]
        + _goodput(summary["goodput"])
        + ["", DEFINITIONS, "", "## Faults", ""]
    )
    parts += _faults(summary["faults"], origin) + [
        "",
        "Times are seconds since the run's first event.",
        "",
        "## Generations and incidents",
        "",
    ]
    parts += _incidents(summary, origin) + ["", "## Final weights against a fault-free run", ""]
    parts += _weights(summary["weights"])
    return "\n".join(parts) + "\n"


def weights_line(w: dict) -> str:
    """The weights check in one line."""
    if not w["available"]:
        return f"unavailable: {w['note']}"
    if w["identical"]:
        return f"bit-identical to the fault-free run ({w['tensors']} tensors)"
    parts = [f"{len(w['differing'])} of {w['tensors']} tensors differ from the fault-free run"]
    numeric = [d for d in w["differing"] if isinstance(d["max_abs_diff"], (int, float))]
    if numeric:
        worst = max(numeric, key=lambda d: d["max_abs_diff"])
        parts.append(f"largest difference {worst['max_abs_diff']:.3g} in {worst['name']}")
    if w["missing"]:
        parts.append(f"{len(w['missing'])} missing")
    if w["extra"]:
        parts.append(f"{len(w['extra'])} extra")
    return "; ".join(parts)


def render_text(summary: dict) -> str:
    """A few plain lines, each under 80 characters, for a terminal (what `transom demo` shows)."""
    g, outcome, counts = summary["goodput"], summary["outcome"], summary["fault_counts"]
    first = f"{outcome['state']} after {g['wall_s']:.1f} s"
    if g.get("launch_s") is not None:
        first += f" (launched {g['launch_s']:.1f} s before)"
    if g["reference_wall_s"] is not None:
        first += f"; the fault-free run took {g['reference_wall_s']:.1f} s ({g['slowdown_x']:.2f}x)"
    lines = [first]
    if g["steps_completed"] is not None:
        lines.append(
            f"{g['steps_completed']} steps, {g['lost_steps']} lost to faults; effective training "
            f"{g['effective_training_s']:.1f} s = {g['effective_ratio_x']:.0%} of wall time"
            if g["effective_ratio_x"] is not None
            else f"{g['steps_completed']} steps, {g['lost_steps']} lost to faults"
        )
    lines.append(f"faults: {counts['recovered']} of {counts['total']} detected and recovered")
    if summary["faults"]:
        lines.append(
            f"  {'fault':<7} {'step':>5} {'node':<7} {'detected':>8} {'by':<10} {'recovered':>9} "
            f"{'lost':>5}  status"
        )
    for r in summary["faults"]:
        by = (
            (r["detected_by"] or "-")
            .replace(" anomaly", "")
            .replace("worker failure (incident)", "incident")
        )
        detected = "-" if r["detection_s"] is None else f"{r['detection_s']:.2f} s"
        recovered = "-" if r["recovery_s"] is None else f"{r['recovery_s']:.2f} s"
        lost = "-" if r["lost_steps"] is None else str(r["lost_steps"])
        lines.append(
            f"  {r['type']:<7} {_cell(r['step']):>5} {r['node'] or '?':<7} {detected:>8} {by:<10} "
            f"{recovered:>9} {lost:>5}  {r['status']}"
        )
    lines.append(f"weights: {summary['weights']['summary']}")
    return "\n".join(lines)
