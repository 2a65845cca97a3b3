"""A buffer database read as an archive: the stored Samples and their groups, read-only.

``inverted view`` reads a finished or running job's ``buffer.db`` here, never through the
service (which may be gone) and never for writing: the file is opened with SQLite's
``mode=ro``, so a viewer cannot change a run, and WAL lets it read while the job writes.
What it reads is incremental: ``samples_after(rowid)`` gives the rows stored since the last
call (a Sample's row id grows with each submission), ``groups_from(index)`` the groups from
the oldest one that may still change state.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

from inverted.errors import ConfigError


@dataclass(slots=True)
class GroupRow:
    group_index: int
    prompt_index: int
    state: str  # one of store.GROUP_STATES
    staleness: int | None  # set when the group was served
    batch_id: str | None
    consumed_at: float | None


class BufferArchive:
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: no buffer database here (a job writes OUTPUT_DIR/buffer.db)")
        self.path = path
        self._db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        self._db.execute("PRAGMA busy_timeout=10000")

    def samples_after(self, rowid: int, limit: int = 10_000) -> list[tuple[int, int, int, bytes]]:
        """``(rowid, group_index, sample_index, sample JSON)`` of up to ``limit`` rows stored after ``rowid``."""
        return self._db.execute(
            "SELECT rowid, group_index, sample_index, sample FROM samples WHERE rowid > ? ORDER BY rowid LIMIT ?",
            (rowid, limit),
        ).fetchall()

    def sample(self, group_index: int, sample_index: int) -> bytes | None:
        row = self._db.execute(
            "SELECT sample FROM samples WHERE group_index = ? AND sample_index = ?", (group_index, sample_index)
        ).fetchone()
        return row[0] if row else None

    def groups_from(self, group_index: int) -> list[GroupRow]:
        """Every group from ``group_index`` on, in order of being served (then of index)."""
        rows = self._db.execute(
            "SELECT group_index, prompt_index, state, staleness, batch_id, consumed_at FROM groups "
            "WHERE group_index >= ? ORDER BY consumed_at IS NULL, consumed_at, group_index",
            (group_index,),
        ).fetchall()
        return [GroupRow(*row) for row in rows]

    def prompt(self, prompt_index: int) -> bytes | None:
        """The prompt record (``datasets.PromptRecord``'s JSON form) a group was made from."""
        row = self._db.execute("SELECT record FROM prompts WHERE prompt_index = ?", (prompt_index,)).fetchone()
        return row[0] if row else None

    def episodes(self) -> list[tuple[bytes, bytes]]:
        """``(prompt record JSON, sample JSON)`` of every stored Sample that did not fail, in the order stored."""
        return self._db.execute(
            "SELECT p.record, s.sample FROM samples s JOIN groups g USING (group_index) "
            "JOIN prompts p USING (prompt_index) WHERE NOT s.failed ORDER BY s.rowid"
        ).fetchall()

    def close(self) -> None:
        self._db.close()
