"""The custom ids seen so far in a file being read line by line (a batch's, a dataset's),
to refuse a repeated one: in memory up to MEMORY ids, then in a temporary SQLite table on
disk (the standard library's), so a million-line file costs the API process a few MB, not
one Python string per line."""
from __future__ import annotations

import sqlite3
import tempfile

MEMORY = 50_000  # ids held in a set before the rest go to disk


class Seen:
    def __init__(self):
        self.ids: set[str] = set()
        self.db: sqlite3.Connection | None = None
        self.dir: tempfile.TemporaryDirectory | None = None

    def add(self, custom_id: str) -> bool:
        """Record `custom_id`; False if it was seen before."""
        if custom_id in self.ids:
            return False
        if len(self.ids) < MEMORY:
            self.ids.add(custom_id)
            return True
        if self.db is None:
            self.dir = tempfile.TemporaryDirectory(prefix="fanout-ids-")
            self.db = sqlite3.connect(f"{self.dir.name}/ids.db", isolation_level=None)
            # Nothing to keep past this process: no journal, no syncs.
            self.db.executescript("PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF; PRAGMA cache_size=-4096;"
                                  "CREATE TABLE ids (id TEXT PRIMARY KEY) WITHOUT ROWID; BEGIN")
        try:
            self.db.execute("INSERT INTO ids VALUES (?)", (custom_id,))
        except sqlite3.IntegrityError:
            return False
        return True

    def close(self) -> None:
        if self.db is not None:
            self.db.close()
            self.dir.cleanup()
            self.db = self.dir = None

    def __enter__(self) -> "Seen":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
