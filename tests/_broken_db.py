"""Damaged and read-only tuning databases, for the tests of every layer that opens one (not a test module).

CI runs as root, which ignores file permissions: a chmod would make nothing read-only there. So a read-only file
is made either by telling the code what a user would be told (`deny_writes`: os.access says no, as for a user
without write permission) or for real, in a private mount namespace where its directory is a read-only bind mount
(`in_readonly_mount`: even root gets EROFS there); that one is skipped where `unshare -m` is not allowed.
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def damage_pages(path: Path, pages: int = 3) -> bytes:
    """Overwrite `pages` pages from the middle of the (closed, checkpointed) SQLite file at `path` with random
    bytes, keeping its header and first page: SQLite still opens it and reads its schema, and only reading those
    pages fails. Returns the damaged file's bytes."""
    data = bytearray(path.read_bytes())
    page_size = int.from_bytes(data[16:18], "big") or 65536
    count = len(data) // page_size
    assert count >= 2 * pages + 2, f"{path} has {count} pages: too few to damage the middle ones"
    rng = random.Random(0)
    for page in range(count // 2, count // 2 + pages):
        data[page * page_size : (page + 1) * page_size] = rng.randbytes(page_size)
    before = path.stat()
    path.write_bytes(bytes(data))
    # another version of the file, as a process opening it later would find it: the clock that stamps mtime ticks
    # every few ms, and a damage made in the same tick as this process's last write would look unchanged
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    return bytes(data)


def damaged_db(path: Path) -> bytes:
    """A tuning database at `path` with 300 decisions and a cost model, then damaged (`damage_pages`)."""
    from autoragged.tuning_db import BatchStats, Decision, TuningDB

    stats = BatchStats.from_lengths((5, 17, 64))
    with TuningDB.open(path) as db:
        db.save_model(device="dev", feature_version=1, kind="k", payload={"a": 1}, metrics={})
        db.add_decisions([Decision(1000.0 + i, "dev", "sig", stats, "padded", None, {"padded": 1.0}, f"r{i}")
                          for i in range(300)])  # fmt: skip
    return damage_pages(path)


def deny_writes(monkeypatch, *paths: Path) -> None:
    """os.access answers "no" for writing to `paths` (files or directories), as it does for a user without the
    permission (root is never refused, so a chmod cannot show this in CI)."""
    denied = {Path(p) for p in paths}
    real = os.access

    def access(p, mode, *args, **kwargs):
        if mode & os.W_OK and Path(p) in denied:
            return False
        return real(p, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)


@functools.cache
def _can_mount() -> bool:
    """Whether `in_readonly_mount` works here (a private mount namespace and a read-only bind mount)."""
    if os.name != "posix" or shutil.which("unshare") is None or shutil.which("mount") is None:
        return False
    with tempfile.TemporaryDirectory() as d:
        script = f'mount --bind "{d}" "{d}" && mount -o remount,ro,bind "{d}" && ! touch "{d}/x" 2>/dev/null'
        probe = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, timeout=30)
    return probe.returncode == 0


def in_readonly_mount(directory: Path, argv: list[str], env: dict | None = None, timeout: float = 240):
    """Run `argv` (a python command line after the interpreter) with `directory` bind-mounted read-only over
    itself in a private mount namespace: nobody, root included, can write there (EROFS). Returns the
    CompletedProcess; skips the test where this machine does not let us make a mount namespace."""
    if not _can_mount():
        pytest.skip("unshare -m / mount --bind are not allowed here (the os.access tests cover the logic)")
    d = str(directory)
    script = f'mount --bind "{d}" "{d}" && mount -o remount,ro,bind "{d}" && exec "$0" "$@"'
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", script, sys.executable, *argv],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
