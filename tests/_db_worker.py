"""A separate process that uses the tuning database, for tests/test_tuning_db.py (not a test module).

    python tests/_db_worker.py write PATH TAG BATCHES PER_BATCH GO_FILE   # prints "ready", waits for GO_FILE,
                                                                          # then adds BATCHES lists of decisions
    python tests/_db_worker.py open PATH GO_FILE                          # waits for GO_FILE, opens, prints version
    python tests/_db_worker.py hold PATH COMMITTED UNCOMMITTED            # commits COMMITTED decisions, then
                                                                          # leaves UNCOMMITTED in an open transaction,
                                                                          # prints "holding WAL_BYTES" and sleeps
Talks to the parent through stdout lines (flushed at once).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autoragged.tuning_db import BatchStats, Decision, TuningDB  # noqa: E402
from autoragged.tuning_db._db import decision_row  # noqa: E402


def make_decisions(tag: str, n: int, start: int = 0) -> list[Decision]:
    """`n` distinct decisions whose reason is `tag:i`."""
    stats = BatchStats.from_lengths((5, 17, 64))
    return [
        Decision(1000.0 + i, "worker-dev", "worker-sig", stats, "padded", None, {"padded": 1.0}, f"{tag}:{i}")
        for i in range(start, start + n)
    ]


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _wait_for(path: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {path}")
        time.sleep(0.001)


def write(path: str, tag: str, batches: str, per_batch: str, go_file: str) -> None:
    with TuningDB.open(path) as db:
        _say("ready")
        _wait_for(go_file)
        for b in range(int(batches)):
            db.add_decisions(make_decisions(tag, int(per_batch), start=b * int(per_batch)))
    _say("done")


def open_(path: str, go_file: str) -> None:
    _wait_for(go_file)
    with TuningDB.open(path) as db:
        _say(f"version {db.schema_version}")


def hold(path: str, committed: str, uncommitted: str) -> None:
    db = TuningDB.open(path)
    db.add_decisions(make_decisions("committed", int(committed)))
    db._conn.execute("PRAGMA cache_size = 10")  # tiny page cache: uncommitted pages spill into the WAL file
    rows = [decision_row(d) for d in make_decisions("uncommitted", int(uncommitted))]
    with db._write("holding a transaction open") as sdb:  # the library's own write path, never committed
        sdb["decisions"].insert_all(rows)
        _say(f"holding {os.path.getsize(path + '-wal')}")
        time.sleep(120)


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    {"write": write, "open": open_, "hold": hold}[mode](*args)
