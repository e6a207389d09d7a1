"""The detection benchmark's table (benchmarks/detection/detection_bench.py): its result,
printed for people.

It only formats; it never runs a job and never changes the result.
"""

from __future__ import annotations

from benchmarks.monitor.overhead import describe as describe_overhead


def fmt(value, spec="{:.2f}") -> str:
    return "-" if value is None else spec.format(value)


def print_table(result: dict) -> None:
    if "patterns" in result:
        pt = result["patterns"]
        print(
            f"log classifier: hardware precision {fmt(pt['patterns_precision_x'], '{:.3f}')}, "
            f"recall {fmt(pt['patterns_recall_x'], '{:.3f}')} ({pt['true_positives']} of "
            f"{pt['hardware_lines']} hardware lines, {pt['false_positives']} false positives "
            f"over {pt['benign_lines']} benign lines); {pt['benign_alerts']} benign lines raised "
            f"as warnings; right type for {fmt(pt['type_accuracy_x'], '{:.3f}')} of "
            f"{pt['hardware_corpus_lines']} labelled lines"
        )
        if not any(result.get(k) for k in ("transom", "fault_free", "overhead")):
            return
    if "script" in result:
        print(f"\nscript: {result['script']} ({result.get('script_path', '?')})")
    if not result["transom"]:
        print_others(result)
        return
    print(
        f"\n{'fault':<11} {'fired':>5} {'found':>5} {'recall':>6} {'precision':>9} "
        f"{'right node':>10} "
        f"{'p50 s':>6} {'p95 s':>6} {'max s':>6} {'steps p50/max':>13} {'median step s':>13}"
    )
    for kind, r in result["transom"].items():
        steps = (
            f"{fmt(r.get('latency_p50_steps'), '{:.0f}')}/"
            f"{fmt(r.get('latency_max_steps'), '{:.0f}')}"
            if "latency_p50_steps" in r
            else "-"
        )
        print(
            f"{kind:<11} {r['faults']:>5} {r['detected']:>5} {fmt(r['recall']):>6} "
            f"{fmt(r['precision']):>9} {fmt(r['attribution']):>10} "
            f"{fmt(r['latency_p50_s']):>6} {fmt(r['latency_p95_s']):>6} "
            f"{fmt(r['latency_max_s']):>6} {steps:>13} {fmt(r['median_step_s'], '{:.3f}'):>13}"
        )
    for kind, r in result["transom"].items():
        if "job_slowdown_p50_x" in r:
            how = (
                f"the rank ran 1/{r['throttle_factor']:g} of the time"
                if "throttle_factor" in r
                else f"fault {r.get('fault', kind)}"
            )
            print(
                f"{kind} on {r['nodes']} nodes: {how}; the job's steps took "
                f"{r['job_slowdown_p50_x']:.2f}x as long (median over the faults of the mean "
                "step time after the fault over before it)"
            )
        if "replays" in r:
            print(
                f"{kind}: {r['replays']} splits without a majority replayed; the replay named "
                f"the right node in {r['replay_right_node']} of {r['faults']} faults, a wrong "
                f"one in {r['replay_wrong_node']}"
            )
        if r.get("overlapped"):
            print(
                f"{kind}: {r['overlapped']} of {r['faults']} faults fired while an earlier one, "
                "not yet answered, still slowed another node: scored apart (recall, right node "
                "and latency are over the others)"
            )
        if "within_target_steps" in r:
            print(
                f"{kind}: found within 30 steps {fmt(r['within_target_steps'])}, within 30 x the "
                f"median step time {fmt(r.get('within_target_s'))} of "
                f"{r['faults'] - r.get('overlapped', 0)} faults "
                f"(latency in median steps p50 {fmt(r.get('latency_p50_median_steps'), '{:.1f}')}"
                f", max {fmt(r.get('latency_max_median_steps'), '{:.1f}')})"
            )
    print_others(result)


def print_others(result: dict) -> None:
    """The fault-free job's line and the monitor overhead's, where they were measured."""
    if "fault_free" in result:
        f = result["fault_free"]
        print(
            f"fault-free job: {f['duration_s'] / 60:.1f} min, "
            f"{f['false_positives']} false positives "
            f"({fmt(f['false_positives_per_hour'], '{:.1f}')} per hour)"
        )
    if "overhead" in result:
        print(describe_overhead(result["overhead"]))
