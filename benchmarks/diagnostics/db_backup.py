"""Copy a tuning database into one consistent file (SQLite's backup API: safe while WAL files exist).

python benchmarks/diagnostics/db_backup.py SRC DST
"""

import sqlite3
import sys

if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    src, dst = sqlite3.connect(sys.argv[1]), sqlite3.connect(sys.argv[2])
    with dst:
        src.backup(dst)
    print(f"copied {sys.argv[1]} -> {sys.argv[2]}")
