"""Decisions and sampled latencies on their way to the tuning database, off the hot path.

The forward pass appends a record to a list (no I/O). A daemon thread writes what accumulated every
few seconds, one transaction per table per flush, and again at interpreter exit; `flush()` writes
now. A database that cannot be opened costs one warning, never an exception in a forward pass; so does one that
cannot be used as it is (`open_db`): a read-only file is read (its cost model) and nothing is recorded into it, and
a damaged one is neither read nor written (the runtime decides with the analytic prior).

Retention: after writing, each flush keeps the newest `keep_decisions` decisions per device and module
signature as rows and adds the older ones up (`TuningDB.prune_decisions` with `report.rollup.rollup`), and keeps
as many of the runtime's timings, deleting the older ones (`TuningDB.prune_measurements`): a transaction each
per flush, never one per forward. `Recorder.keep_decisions` None (the default) reads
`$AUTORAGGED_DB_KEEP_DECISIONS` at each flush (default 20,000; "all" keeps every row); an int overrides it.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections import deque
from pathlib import Path

from ..tuning_db import (
    DamagedDatabase,
    DatabaseError,
    Decision,
    DeviceKey,
    Measurement,
    ReadOnlyDatabase,
    TuningDB,
    keep_decisions,
)  # fmt: skip

__all__ = ["RECORDER", "Recorder"]

log = logging.getLogger("autoragged")


class Recorder:
    def __init__(self, interval_s: float = 5.0, high_water: int = 4096, keep_decisions: int | str | None = None):
        """keep_decisions: decisions kept as rows per (device, signature); None reads the environment at each
        flush (see the module docstring), "all" keeps every row."""
        self.interval_s = interval_s
        self.high_water = high_water
        self.keep_decisions = keep_decisions
        self._lock = threading.Lock()  # guards the dict of queues and the thread start, not the appends
        self._wake = threading.Event()
        self._queues: dict[Path, deque] = {}
        self._dbs: dict[Path, TuningDB | None] = {}  # None: a damaged file, neither read nor written
        self._broken: set[Path] = set()  # nothing is recorded there (a write failed, or read-only, or damaged)
        self._unusable: dict[Path, str] = {}  # paths that could not be opened, and why (warned once)
        self._prune_failed: set[Path] = set()
        self._thread: threading.Thread | None = None
        self._flush_lock = threading.Lock()

    # -- producer side (the hot path: one deque append, atomic in CPython, no lock) -------------
    def add(self, path: Path, device: DeviceKey, decision=None, measurement: Measurement | None = None) -> None:
        """Queue a decision (a `Decision`, or any object whose `.decision()` makes one at flush time, so the
        hot path builds nothing) and/or a measurement for `path`."""
        q = self._queues.get(path)
        if q is None:
            if path in self._broken:
                return
            with self._lock:
                q = self._queues.setdefault(path, deque())
        q.append((device, decision, measurement))
        if self._thread is None:
            self._start()
        elif len(q) >= self.high_water and not self._wake.is_set():
            self._wake.set()

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._loop, name="autoragged-recorder", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - the recorder must never take the process down
                log.exception("autoragged: flushing decisions to the tuning database failed")

    # -- consumer side ----------------------------------------------------------------------
    def open_db(self, path: Path) -> TuningDB | None:
        """The runtime's connection to `path`, opened once. A file this process cannot write is opened read-only
        (its cost model is read, nothing is recorded), and a damaged one gives None (neither read nor written):
        each costs one WARNING saying so. Raises DatabaseError where the path cannot be used at all (a directory,
        a directory that cannot be made, a schema from a newer autoragged)."""
        if path in self._dbs:
            return self._dbs[path]
        try:
            try:
                db = TuningDB.open(path)
            except ReadOnlyDatabase as e:
                db = TuningDB.open(path, readonly=True)
                self._stop_recording(path, f"autoragged: {e}: using its cost model, recording nothing")
        except DamagedDatabase as e:
            db = None
            self._stop_recording(path, f"autoragged: {e}; deciding with the analytic prior, recording nothing")
        self._dbs[path] = db
        return db

    def usable_db(self, path: Path) -> TuningDB | None:
        """`open_db(path)`, or None where it cannot be opened, with one WARNING per path saying why."""
        try:
            return self.open_db(path)
        except DatabaseError as e:
            if path not in self._unusable:
                self._unusable[path] = str(e)
                self._stop_recording(path, f"autoragged: {e}; deciding with the analytic prior, recording nothing")
            return None

    def _stop_recording(self, path: Path, warning: str) -> None:
        self._broken.add(path)
        self._queues.pop(path, None)
        log.warning("%s", warning)

    def flush(self) -> int:
        """Write everything queued so far (one transaction per table and path); returns the rows written.

        A record that cannot be stored (a NaN where a number must be, a value JSON cannot hold) is left out and
        counted in one warning per flush; every other record of the flush is written."""
        written = 0
        with self._flush_lock:
            for path, q in list(self._queues.items()):
                items = []
                while q:  # popleft is atomic too: producers may keep appending meanwhile
                    items.append(q.popleft())
                if not items or path in self._broken:
                    continue
                written += self._write(path, items)
        return written

    def _write(self, path: Path, items: list) -> int:
        devices = {d.key: d for d, _, _ in items}
        decisions, bad = _decisions(items)
        measurements = [m for _, _, m in items if m is not None]
        written = 0
        db = self.usable_db(path)
        if db is None or db.readonly:
            return 0  # said once, when it was opened
        try:
            for device in devices.values():
                db.register_device(device)
            written += db.add_decisions(decisions, skipped=bad) if decisions else 0
            written += db.add_measurements(measurements, skipped=bad) if measurements else 0
        except DatabaseError as e:
            self._broken.add(path)
            self._queues.pop(path, None)
            log.warning("autoragged: not recording decisions any more: %s", e)
            return written
        keep = self._keep()
        if keep is not None:
            self._prune(db, keep, decisions, measurements)
        if bad:
            total = sum(x is not None for _, x, _ in items) + len(measurements)
            log.warning("autoragged: left %d of %d records out of %s: they cannot be stored (%s)",
                        len(bad), total, path, bad[0][1])  # fmt: skip
        return written

    def _prune(self, db: TuningDB, keep: int, decisions: list[Decision], measurements: list[Measurement]) -> None:
        """Bound what the flush wrote (see the module docstring). A failure here (another writer holding the lock
        past the busy timeout, a damaged file) costs one warning per file and is retried at the next flush: the
        records themselves are written."""
        from ..report.rollup import rollup

        timed = {(m.device, m.signature) for m in measurements if m.source == "runtime"}
        try:
            if decisions:
                db.prune_decisions(keep, rollup, pairs={(d.device, d.signature) for d in decisions})
            if timed:
                db.prune_measurements(keep, pairs=timed)
        except Exception as e:  # noqa: BLE001 - retention must never stop the recording
            if db.path not in self._prune_failed:
                self._prune_failed.add(db.path)
                log.warning("autoragged: could not prune old decisions or timings in %s (retried at each flush): %s",
                            db.path, e)  # fmt: skip

    def _keep(self) -> int | None:
        if self.keep_decisions is None:
            return keep_decisions()
        return None if self.keep_decisions == "all" else self.keep_decisions


def _decisions(items: list) -> tuple[list[Decision], list[tuple[object, str]]]:
    """The queued decisions as `Decision`s, and (record, why) for those that could not be made into one."""
    decisions, bad = [], []
    for _, x, _ in items:
        if x is None:
            continue
        try:
            decisions.append(x if isinstance(x, Decision) else x.decision())
        except Exception as e:  # noqa: BLE001 - one record must not cost the others theirs
            bad.append((x, f"{type(e).__name__}: {e}"))
    return decisions, bad


RECORDER = Recorder()
atexit.register(RECORDER.flush)
