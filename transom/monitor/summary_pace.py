"""How often a node agent's monitor summary goes out: the periods, step counts and the
attentive spell that transom.monitor.node's `due` and `steps_due` apply.

A summary is an etcd write on every node (issue 44: at most about one request a node a second in
all), so it goes out when the controller has something to learn from it. This module only holds
the numbers and the spell's rule; it never reads a clock or writes anything.
"""

from __future__ import annotations

from transom.common.records import RankSummary
from transom.monitor import waiting

# A summary is collected at least this often (written only when it changed or its keep-alive is
# due: transom.control.node_reports).
SUMMARY_PERIOD_S = 1.0
# A summary also goes out once a rank advanced SUMMARY_STEPS steps since the last, or advanced at
# all and its timings shifted (waiting.timings_shifted: a rank beginning to lag), at most every
# SUMMARY_MIN_PERIOD_S: the straggler detector's latency is counted in steps, so a fast job's
# summaries must not lag many steps behind (a job of 1 s steps still publishes every second).
# More often than every 0.5 s gains nothing: a straggler is confirmed over 0.5 s at least
# (waiting.STRONG_MIN_S; 1 s unless the evidence is strong), and the simulated 1.5x slowdown is
# found as soon at 0.5 s as at 0.25 s.
SUMMARY_STEPS = 4
SUMMARY_MIN_PERIOD_S = 0.5
# ... but the SUMMARY_STEPS rule only for this long after a rank's timings shifted (a straggler
# being confirmed, or cleared, over the next steps): in a steady job whose timings do not move,
# steps alone are no news to the straggler detector, and the summaries go at the agent's
# keep-alive (every 0.5 s was two etcd requests a node a second on a fast job).
# While attentive, a rank that advanced at all is also news every ATTENTIVE_PERIOD_S (a job of
# slow steps is confirmed as fast as at a keep-alive of that period). A rank slower, by the
# bar, than in the spell's first summary extends the spell (`attend`): a slowdown that grew a
# little at each summary never shifted from one to the next. On a loaded 2-core machine a
# fault-free job of 50 ms steps shifts by noise every few seconds, so these bound what noise
# costs etcd.
ATTENTIVE_S = 5.0
ATTENTIVE_PERIOD_S = 2.0
# A new replica fingerprint goes out at most this often, not held for SUMMARY_MIN_PERIOD_S: each
# step a corruption goes unfound is computed again (the default interval is 8 s or more).
FINGERPRINT_MIN_PERIOD_S = 0.1


def attend(
    until: float,
    spell: dict[str, RankSummary] | None,
    views: dict[str, RankSummary],
    now: float,
) -> tuple[float, dict[str, RankSummary] | None]:
    """The attentive spell (its end, and the ranks' views in its first summary) after a summary
    of `views` published at `now`: extended when a rank is slower, by the bar, than in the
    spell's first summary. That is a slowdown that grew a little at each summary, never a shift
    from one to the next: the generation's first seconds publish every few steps, and a rank
    slowed then was published a bit slower every half second, then at the keep-alive once the
    spell ended, while the controller waited for its next window to confirm it."""
    if now >= until:
        return until, None
    if spell is None:
        return until, dict(views)
    if waiting.ranks_shifted(spell, views, slower_only=True):
        return now + ATTENTIVE_S, dict(views)
    return until, spell
