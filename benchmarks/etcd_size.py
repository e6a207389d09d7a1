"""Does the embedded etcd's database stay bounded under a job's sustained rewrites?

Starts an embedded etcd (as `transom run` does: auto-compaction on, `EtcdUpkeep` running),
rewrites `--keys` keys (like nodes' statuses and monitor summaries) at `--rate` writes a second
with `--value-bytes` values for `--minutes`, and prints the database size every `--every`
seconds, then a JSON line with the sizes at start and end and what was written in all.

    python -m benchmarks.etcd_size --minutes 30

It measures only; it must never be pointed at an etcd other than the one it starts.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from transom.store import EmbeddedEtcd, Store
from transom.store.upkeep import EtcdUpkeep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=100.0, help="writes a second")
    parser.add_argument("--keys", type=int, default=16)
    parser.add_argument("--value-bytes", type=int, default=2048)
    parser.add_argument("--every", type=float, default=30.0, help="seconds between size reports")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedEtcd(Path(tmp) / "etcd") as etcd:
        store = Store(etcd.access, "size-bench", deadline_s=30.0)
        upkeep = EtcdUpkeep(
            Store(etcd.access, "size-bench", timeout=60, deadline_s=60), etcd.quota_bytes
        )
        upkeep.start()
        try:
            start = upkeep.status()
            began = time.monotonic()
            end_at = began + args.minutes * 60
            next_report = began
            written = 0
            payload = "x" * args.value_bytes
            while (now := time.monotonic()) < end_at:
                if now >= next_report:
                    s = upkeep.status()
                    print(
                        f"{now - began:7.0f} s  db {s.db_size / 2**20:7.2f} MiB  "
                        f"in use {s.db_in_use / 2**20:7.2f} MiB  revision {s.revision}",
                        flush=True,
                    )
                    next_report += args.every
                store.put(f"status/k{written % args.keys}", {"n": written, "data": payload})
                written += 1
                time.sleep(max(0.0, began + written / args.rate - time.monotonic()))
            end = upkeep.status()
        finally:
            upkeep.stop()
    print(
        json.dumps(
            {
                "minutes": args.minutes,
                "writes": written,
                "written_mib": round(written * args.value_bytes / 2**20, 1),
                "db_start_mib": round(start.db_size / 2**20, 2),
                "db_end_mib": round(end.db_size / 2**20, 2),
                "db_in_use_end_mib": round(end.db_in_use / 2**20, 2),
                "defrags": upkeep.defrags,
                "alarms_handled": upkeep.alarms_handled,
            }
        )
    )


if __name__ == "__main__":
    main()
