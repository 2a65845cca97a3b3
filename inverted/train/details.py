"""What the trainer saw of each Sample it trained on, kept for ``inverted view``.

With ``--save-train-details`` (the default) rank 0 writes one row per trained Sample into
``OUTPUT_DIR/train_details.db`` after each rollout, in one transaction:

- the step (the rollout id that trained it) and the Sample's key: group, index and branch;
- ``log_probs``: the trainer's log-prob of every response token under the weights that sampled
  the step (PPO's "old" log-probs: what the importance ratio, TIS and the mismatch metric compare
  with the rollout's), float32 little-endian;
- ``advantages``: the per-token advantages the loss used, float32 little-endian;
- ``mismatch``: the mean of ``|trainer - rollout|`` over the tokens in the loss (the per-Sample
  form of ``train/train_rollout_logprob_abs_diff``), and ``advantage``, their mean advantage.

The format is defined here only: the trainer writes it (``DetailsWriter``), the viewer reads it
(``DetailsReader``). SQLite, so a viewer can read while a running job writes (WAL).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FILE_NAME = "train_details.db"
SCHEMA = """
CREATE TABLE IF NOT EXISTS details (
    group_index INTEGER NOT NULL, sample_index INTEGER NOT NULL, branch INTEGER NOT NULL, step INTEGER NOT NULL,
    mismatch REAL, advantage REAL, log_probs BLOB NOT NULL, advantages BLOB NOT NULL,
    PRIMARY KEY (group_index, sample_index, branch));
"""


@dataclass(slots=True)
class Detail:
    """One trained Sample's row."""

    group_index: int
    sample_index: int
    branch: int
    step: int
    mismatch: float | None
    advantage: float | None
    log_probs: np.ndarray  # float32, one per response token
    advantages: np.ndarray

    def encoded(self) -> tuple:
        return (
            self.group_index,
            self.sample_index,
            self.branch,
            self.step,
            self.mismatch,
            self.advantage,
            self.log_probs.astype("<f4").tobytes(),
            self.advantages.astype("<f4").tobytes(),
        )


def summarise(
    log_probs: np.ndarray, rollout: np.ndarray | None, advantages: np.ndarray, mask: np.ndarray
) -> tuple[float | None, float | None]:
    """(mismatch, mean advantage) over the tokens in the loss; None where no token is, and no
    mismatch where the sampler recorded no log-probs (``rollout`` None)."""
    on = mask.astype(bool)
    if not on.any():
        return None, None
    mismatch = None if rollout is None else float(np.abs(log_probs[on] - rollout[on]).mean())
    return mismatch, float(advantages[on].mean())


class DetailsWriter:
    """Appends each step's rows (rank 0 of the trainer)."""

    def __init__(self, output_dir: str | Path) -> None:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(Path(output_dir) / FILE_NAME, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(SCHEMA)

    def write(self, details: list[Detail]) -> None:
        # A resumed run may train a Sample's key again (a step that was lost): the newest row wins.
        self._db.execute("BEGIN")
        self._db.executemany(
            "INSERT OR REPLACE INTO details VALUES (?, ?, ?, ?, ?, ?, ?, ?)", [d.encoded() for d in details]
        )
        self._db.execute("COMMIT")

    def close(self) -> None:
        self._db.close()


class DetailsReader:
    """Read-only access for the viewer; an absent file reads as empty."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / FILE_NAME
        self._db: sqlite3.Connection | None = None

    def _connection(self) -> sqlite3.Connection | None:
        if self._db is None and self.path.exists():
            self._db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False)
        return self._db

    def summaries(self, after_rowid: int = 0) -> list[tuple[int, int, int, int, int, float | None, float | None]]:
        """``(rowid, group, index, branch, step, mismatch, advantage)`` of the rows written since ``after_rowid``."""
        db = self._connection()
        if db is None:
            return []
        return db.execute(
            "SELECT rowid, group_index, sample_index, branch, step, mismatch, advantage FROM details "
            "WHERE rowid > ? ORDER BY rowid",
            (after_rowid,),
        ).fetchall()

    def get(self, group_index: int, sample_index: int, branch: int) -> Detail | None:
        db = self._connection()
        row = (
            db
            and db.execute(
                "SELECT group_index, sample_index, branch, step, mismatch, advantage, log_probs, "
                "advantages FROM details WHERE group_index = ? AND sample_index = ? AND branch = ?",
                (group_index, sample_index, branch),
            ).fetchone()
        )
        if not row:
            return None
        group, index, branch, step, mismatch, advantage, log_probs, advantages = row
        return Detail(
            group,
            index,
            branch,
            step,
            mismatch,
            advantage,
            np.frombuffer(log_probs, dtype="<f4"),
            np.frombuffer(advantages, dtype="<f4"),
        )
