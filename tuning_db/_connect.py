"""Opening the tuning database's SQLite file: where it may live, the connection (WAL, explicit transactions,
any thread), the migrations a writer applies and the schema a reader needs. `TuningDB.open` (_db.py) runs these."""

from __future__ import annotations

import logging
import os
import random
import sqlite3
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ._errors import DamagedDatabase, DatabaseError, ReadOnlyDatabase, explain, sqlite_code
from .migrations import MIGRATIONS, MIGRATIONS_TABLE, READER_OPTIONAL, applied_migrations, migrate, unknown_migrations

if TYPE_CHECKING:
    import sqlite_utils

__all__ = [
    "ENV_VAR", "BUSY_TIMEOUT_S", "directory_error", "check_location", "check_intact", "connect_optuna", "connect_wal",
    "connect_readonly", "migrate_checked", "check_readable",
]  # fmt: skip

log = logging.getLogger("autoragged")

ENV_VAR = "AUTORAGGED_DB"
BUSY_TIMEOUT_S = 30.0  # how long a writer waits for another process's write transaction before failing


# Where users name the database (TuningDB.open's path= is not one of them).
_PASS_A_FILE = f"wrap's db=, the --db of tune and report, or ${ENV_VAR}"


def directory_error(path: Path) -> DatabaseError:
    return DatabaseError(
        f"the tuning database path {path} is a directory; name a file in it ({_PASS_A_FILE}), "
        f"e.g. {path / 'tuning.sqlite'}"
    )


def check_location(path: Path) -> None:
    """Fail early, with the remedy, on a path SQLite could only report as 'unable to open database file', and on a
    file this process cannot write (ReadOnlyDatabase: it can be opened read-only). os.access is the kernel's own
    answer for this process: root may write a file without write permission, but not on a read-only mount."""
    if path.is_dir():
        raise directory_error(path)
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DatabaseError(
            f"cannot create the directory {parent} for the tuning database {path} ({e}); "
            f"name a file in a writable directory ({_PASS_A_FILE})"
        ) from e
    if not os.access(parent, os.W_OK | os.X_OK):
        why = f"its directory {parent} is not writable, and SQLite keeps {path.name}-wal and {path.name}-shm beside it"
        if path.exists():
            raise ReadOnlyDatabase(f"the tuning database {path} is read-only ({why}); it can be read, not written")
        raise DatabaseError(
            f"the directory {parent} of the tuning database {path} is not writable (SQLite keeps "
            f"{path.name}-wal and {path.name}-shm beside the file); make it writable or set {ENV_VAR} elsewhere"
        )
    if path.exists() and not os.access(path, os.W_OK):
        raise ReadOnlyDatabase(
            f"the tuning database {path} is read-only (this process may not write the file); it can be read, "
            "not written"
        )


# Files found intact, by (path, device, inode, size, mtime): PRAGMA quick_check reads every page (86 ms for a 74 MB
# file on a 2-core CPU), so each version of a file is checked once per process.
_INTACT: set[tuple] = set()


def _quick_check(conn: sqlite3.Connection, path: Path) -> str | None:
    """The first problem `PRAGMA quick_check` finds in the file (page structure, not every index entry), or None."""
    try:
        rows = conn.execute("PRAGMA quick_check(1)").fetchall()
    except sqlite3.DatabaseError as e:  # a page too damaged to walk: SQLite stops with "malformed"
        if isinstance(explain(e, path, "checking it"), DamagedDatabase):
            return str(e)
        raise
    problem = str(rows[0][0]) if rows else "no answer"
    return None if problem == "ok" else " ".join(problem.split())  # its report spans lines


def check_intact(conn: sqlite3.Connection, path: Path) -> None:
    """Refuse a file with damaged pages before anything reads or writes it (SQLite itself fails only on the queries
    that read them, and a writer went on adding rows to such a file)."""
    try:
        st = path.stat()
    except OSError:
        return  # SQLite has not made it yet: nothing to check
    key = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if st.st_size == 0 or key in _INTACT:
        return
    problem = _quick_check(conn, path)
    if problem is not None:
        raise DamagedDatabase(
            f"the tuning database {path} is damaged (SQLite's quick_check: {problem}); nothing was read from it or "
            f"written to it; move it away (the next run makes a new one) or name another file ({_PASS_A_FILE})"
        )
    _INTACT.add(key)


def _journal_mode_wal(conn: sqlite3.Connection) -> str:
    """Switch to WAL, retrying while another process holds the lock: the switch needs an exclusive lock and
    SQLite can report "database is locked" at once instead of waiting out the busy timeout (seen when four
    processes opened a fresh file together, tests/test_tuning_db.py)."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    delay = 0.002
    while True:
        try:
            mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
            if mode != "wal":
                mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            return mode
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) and "busy" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(delay * (1 + random.random()))
            delay = min(delay * 2, 0.1)


def _decode_text(data: bytes) -> str:
    """TEXT as str; invalid UTF-8 (a damaged row) is replaced rather than failing the whole query."""
    return data.decode("utf-8", "replace")


def connect_optuna(path: str) -> sqlite3.Connection:
    """optuna's connection to the file (SQLAlchemy's `creator`): its own transactions, the same busy timeout."""
    return sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, check_same_thread=False)


def connect_wal(path: Path) -> sqlite3.Connection:
    """A connection with explicit transactions, usable from any thread, in WAL mode."""
    conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_S, check_same_thread=False, isolation_level=None)
    conn.text_factory = _decode_text
    try:
        mode = _journal_mode_wal(conn)
        if mode != "wal":
            log.warning("tuning database %s cannot use WAL (journal_mode=%s); writers will wait on readers", path, mode)
        # In WAL mode NORMAL survives a killed process (commits are in the WAL); a power cut may lose the
        # last transactions but never corrupts the file. FULL would fsync every flush of decisions.
        conn.execute("PRAGMA synchronous=NORMAL")
    except BaseException:
        conn.close()
        raise
    return conn


def _check_not_newer(db: sqlite_utils.Database, path: Path) -> None:
    unknown = unknown_migrations(applied_migrations(db))
    if unknown:
        raise DatabaseError(
            f"the tuning database {path} was written by a newer autoragged (schema migrations unknown here: "
            f"{', '.join(unknown)}); upgrade autoragged, or set {ENV_VAR} to another file"
        )


def _uri_connect(path: Path, query: str) -> sqlite3.Connection:
    conn = sqlite3.connect(
        f"{path.as_uri()}?{query}", uri=True, timeout=BUSY_TIMEOUT_S, check_same_thread=False, isolation_level=None
    )
    conn.text_factory = _decode_text
    return conn


def connect_readonly(path: Path) -> sqlite3.Connection:
    """A read-only connection. A reader of a WAL file needs its -shm file: in a directory it cannot write, where
    none is there, SQLite refuses the file ("unable to open database file", or "attempt to write a readonly
    database"), so the file is then opened as immutable: no locks, and no WAL read (a writer's last close
    checkpoints the WAL into the file, so a file shipped read-only has none)."""
    conn = _uri_connect(path, "mode=ro")
    try:
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return conn
    except sqlite3.OperationalError as e:
        conn.close()
        text = str(e)
        if not (sqlite_code(e).startswith(("SQLITE_CANTOPEN", "SQLITE_READONLY")) or "unable to open" in text
                or "readonly" in text):  # fmt: skip
            raise
        log.debug("tuning database %s: read as immutable (%s)", path, e)
    return _uri_connect(path, "mode=ro&immutable=1")


def migrate_checked(db: sqlite_utils.Database, path: Path) -> None:
    """A writer's preparation: apply the migrations this autoragged knows, refusing a file a newer one wrote."""
    _check_not_newer(db, path)
    applied = migrate(db)
    _check_not_newer(db, path)  # a newer process may have migrated while we did
    log.debug("tuning database %s open (schema %d, applied now: %s)", path, len(MIGRATIONS), applied)


def check_readable(db: sqlite_utils.Database, path: Path) -> None:
    """A reader must not change a file it was merely pointed at: refuse what it would have to migrate."""
    _check_not_newer(db, path)
    applied = applied_migrations(db)
    if not applied:
        raise DatabaseError(f"{path} is not a tuning database (it has no {MIGRATIONS_TABLE} table)")
    missing = [name for name, _ in MIGRATIONS if name not in applied and name not in READER_OPTIONAL]
    if missing:
        raise DatabaseError(
            f"the tuning database {path} is at an older schema (missing {', '.join(missing)}); open it "
            "read-write once to migrate it, e.g. python -m autoragged.tune --refit"
        )
