"""`DatabaseError`: every failure of the tuning database, with the path, what is wrong and what to do."""

from __future__ import annotations

import sqlite3
from pathlib import Path

__all__ = ["DatabaseError", "DamagedDatabase", "ReadOnlyDatabase", "RowError", "explain", "sqlite_code"]

_MOVE_AWAY = "move it away or point AUTORAGGED_DB elsewhere"


class DatabaseError(Exception):
    """The tuning database cannot be opened, read or written; the message names the file and the remedy."""


class DamagedDatabase(DatabaseError):
    """The file cannot be read as SQLite: damaged pages (found by `PRAGMA quick_check` when it is opened, or by a
    query that reads them), or not SQLite at all. Nothing should read from it or write into it."""


class ReadOnlyDatabase(DatabaseError):
    """The file, or the directory SQLite keeps its -wal and -shm files in, cannot be written. It can still be read:
    `TuningDB.open(path, readonly=True)`."""


class RowError(DatabaseError):
    """One row cannot be read as what its table holds (damaged, or written by something hostile).

    table, row_id, problem: which row and what is wrong with it; the message also names the file and the remedy.
    """

    def __init__(self, path: Path, table: str, row_id: object, problem: str):
        self.path, self.table, self.row_id, self.problem = path, table, row_id, problem
        remedy = (
            "re-run python -m autoragged.tune --refit for a new model, or delete the row"
            if table == "models"
            else "delete the row, or read with a Skipped collector to leave such rows out"
        )
        super().__init__(f"{table} row {row_id} of the tuning database {path}: {problem}; {remedy}")


def sqlite_code(error: sqlite3.Error) -> str:
    """SQLite's error name (`SQLITE_CORRUPT`, ...) where Python exposes it (3.11+), else ""."""
    return getattr(error, "sqlite_errorname", "") or ""


def explain(error: sqlite3.Error, path: Path, doing: str) -> DatabaseError:
    """Translate a sqlite3 error raised while `doing` (e.g. "writing decisions") into a DatabaseError."""
    text = str(error)
    code = sqlite_code(error)
    if code.startswith("SQLITE_CORRUPT") or "malformed" in text:
        return DamagedDatabase(
            f"the tuning database {path} is damaged: SQLite found it corrupt while {doing} ({text}); {_MOVE_AWAY}"
        )
    if code.startswith("SQLITE_NOTADB") or "not a database" in text:
        return DamagedDatabase(
            f"the file is not a tuning database (corrupt or not SQLite): {path}; {_MOVE_AWAY} ({text})"
        )
    if code.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in text:
        return DatabaseError(
            f"{path} stayed locked by another process through the whole busy timeout while {doing} ({text}); "
            "retry when the other writer (a tune run?) has finished, or point AUTORAGGED_DB elsewhere"
        )
    if code.startswith("SQLITE_READONLY") or "readonly" in text:
        return ReadOnlyDatabase(
            f"the tuning database {path} is read-only ({text}) while {doing}; make it writable or {_MOVE_AWAY}"
        )
    if code.startswith("SQLITE_CANTOPEN") or "unable to open" in text:
        return DatabaseError(
            f"cannot open the tuning database {path} ({text}); check that its directory exists and is writable, "
            "or point AUTORAGGED_DB elsewhere"
        )
    if code.startswith("SQLITE_FULL") or "disk is full" in text:
        return DatabaseError(f"disk full while {doing} in {path} ({text}); free some space and retry")
    return DatabaseError(f"tuning database {path}: {text} (while {doing})")
