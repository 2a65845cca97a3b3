"""A run directory as the viewer sees it: an index of its Samples, its metrics, one trajectory in full.

``RunIndex`` reads three things a job leaves in its output directory, all read-only:

- ``buffer.db`` (``buffer.archive``): every stored Sample and its group's fate;
- ``train_details.db`` (``train.details``): the trainer's log-probs and advantages per Sample;
- ``metrics.jsonl``: one row per step and per evaluation.

The Samples table a user filters and sorts would need every stored Sample parsed on each request,
so the index keeps one summary row per Sample (per branch: a session's branches are stored together)
in an in-memory SQLite table with an index per sortable column. ``refresh`` adds what the job wrote
since the last call (new Samples by row id, groups that may still change state, new trainer rows),
so a running job's pages stay current at the cost of what changed. A filtered page is then one
indexed query (``page``); a trajectory is read from the buffer when asked for (``trajectory``).

A Sample's **step** is the rollout that trained it (from the trainer's rows), else the ordinal of
the batch that served it (a run without a trainer, or a step not yet trained); its **staleness**
is its group's when served (the buffer's: policy version minus the oldest token's version).
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from inverted.buffer.archive import BufferArchive
from inverted.train.details import DetailsReader
from inverted.types import decode_routed_experts, reward_number, version_number

COLUMNS = (
    "group_index",
    "sample_index",
    "branch",
    "step",
    "reward",
    "response_length",
    "prompt_length",
    "status",
    "staleness",
    "mismatch",
    "advantage",
    "turns",
    "branches",
    "version_min",
    "version_max",
    "group_state",
)
SORTABLE = frozenset(COLUMNS)
STATUSES = ("completed", "truncated", "aborted", "failed", "pending")

SCHEMA = """
CREATE TABLE samples (
    group_index INTEGER NOT NULL, sample_index INTEGER NOT NULL, branch INTEGER NOT NULL,
    sibling INTEGER NOT NULL,  -- where the stored row keeps it: -1 the row itself, else metadata.siblings[i]
    trained_step INTEGER, batch_step INTEGER, step INTEGER GENERATED ALWAYS AS (COALESCE(trained_step, batch_step)),
    reward REAL, response_length INTEGER NOT NULL, prompt_length INTEGER NOT NULL, status TEXT NOT NULL,
    staleness INTEGER, mismatch REAL, advantage REAL, turns INTEGER NOT NULL, branches INTEGER NOT NULL,
    version_min INTEGER, version_max INTEGER, group_state TEXT,
    PRIMARY KEY (group_index, sample_index, branch));
"""
INDEXED = ("step", "reward", "response_length", "staleness", "mismatch", "advantage", "status")


@dataclass(kw_only=True, slots=True)
class SampleQuery:
    """One page of the Samples table: filters (None: any), a sort and a page."""

    step_min: int | None = None
    step_max: int | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    length_min: int | None = None
    length_max: int | None = None
    staleness_min: int | None = None
    mismatch_min: float | None = None
    group: int | None = None
    status: list[str] | None = None
    zero_variance: bool = False  # only groups whose Samples all have the same reward (nothing to learn)
    sort: str = "group_index"
    descending: bool = False
    page: int = 0
    page_size: int = 50

    def clauses(self) -> tuple[str, list[Any]]:
        where, args = [], []
        for name, column, op in (
            ("step_min", "step", ">="),
            ("step_max", "step", "<="),
            ("reward_min", "reward", ">="),
            ("reward_max", "reward", "<="),
            ("length_min", "response_length", ">="),
            ("length_max", "response_length", "<="),
            ("staleness_min", "staleness", ">="),
            ("mismatch_min", "mismatch", ">="),
            ("group", "group_index", "="),
        ):
            value = getattr(self, name)
            if value is not None:
                where.append(f"{column} {op} ?")
                args.append(value)
        if self.status:
            where.append(f"status IN ({', '.join('?' * len(self.status))})")
            args += self.status
        if self.zero_variance:
            where.append(
                "group_index IN (SELECT group_index FROM samples GROUP BY group_index "
                "HAVING COUNT(*) > 1 AND MIN(reward) = MAX(reward))"
            )
        return (" WHERE " + " AND ".join(where)) if where else "", args


class RunIndex:
    """The viewer's picture of one run directory; thread-safe (calls are serialised)."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        reward_key: str | None = None,
        tokenizer: Any = None,
        experts_shape: tuple[int, int] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.archive = BufferArchive(self.run_dir / "buffer.db")
        self.details = DetailsReader(self.run_dir)
        self.reward_key, self.tokenizer, self.experts_shape = reward_key, tokenizer, experts_shape
        self._db = sqlite3.connect(":memory:", check_same_thread=False)
        self._db.executescript(SCHEMA)
        for column in INDEXED:
            self._db.execute(f"CREATE INDEX by_{column} ON samples ({column}, group_index, sample_index, branch)")
        self._lock = threading.Lock()
        self._sample_rowid = self._details_rowid = 0
        self._group_floor = 0  # groups below it can no longer change
        self._batch_steps: dict[str, int] = {}
        self._metrics: list[dict[str, Any]] = []
        self._metrics_offset = 0
        self._texts: dict[int, str] = {}

    # ---- keeping up with the job -----------------------------------------------------------

    def refresh(self) -> None:
        """Take in what the job wrote since the last call."""
        with self._lock:
            while rows := self.archive.samples_after(self._sample_rowid):
                self._db.executemany(
                    f"INSERT OR REPLACE INTO samples ({', '.join(SUMMARY)}) VALUES ({', '.join('?' * len(SUMMARY))})",
                    [summary for row in rows for summary in self._summaries(row[3])],
                )
                self._sample_rowid = rows[-1][0]
            self._take_groups()
            detail_rows = self.details.summaries(self._details_rowid)
            if detail_rows:
                self._db.executemany(
                    "UPDATE samples SET trained_step = ?, mismatch = ?, advantage = ? "
                    "WHERE group_index = ? AND sample_index = ? AND branch = ?",
                    [(step, mismatch, advantage, g, i, b) for _, g, i, b, step, mismatch, advantage in detail_rows],
                )
                self._details_rowid = detail_rows[-1][0]
            self._read_metrics()

    def _summaries(self, blob: bytes) -> list[tuple]:
        data = orjson.loads(blob)
        siblings = (data.get("metadata") or {}).get("siblings") or []
        return [self._summary(data, -1)] + [self._summary(s, i) for i, s in enumerate(siblings)]

    def _summary(self, data: dict[str, Any], sibling: int) -> tuple:
        metadata = data.get("metadata") or {}
        versions = [version_number(v) for v in data.get("weight_versions") or []]
        response = data.get("response_length", 0)
        return (
            data.get("group_index"),
            data.get("index"),
            int(metadata.get("branch", 0)),
            sibling,
            reward_number(data.get("reward"), self.reward_key),
            response,
            len(data.get("tokens") or []) - response,
            data.get("status", "pending"),
            len(metadata.get("turns") or []) or 1,
            int(metadata.get("branches", 1)),
            min(versions, default=None),
            max(versions, default=None),
        )

    def _take_groups(self) -> None:
        groups = self.archive.groups_from(self._group_floor)
        if not groups:
            return
        for group in groups:
            if group.batch_id is not None and group.batch_id not in self._batch_steps:
                self._batch_steps[group.batch_id] = len(self._batch_steps)
        self._db.executemany(
            "UPDATE samples SET group_state = ?, staleness = ?, batch_step = ? WHERE group_index = ?",
            [(g.state, g.staleness, self._batch_steps.get(g.batch_id or ""), g.group_index) for g in groups],
        )
        waiting = [g.group_index for g in groups if g.state in ("open", "complete")]
        self._group_floor = min(waiting) if waiting else max(g.group_index for g in groups) + 1

    def _read_metrics(self) -> None:
        path = self.run_dir / "metrics.jsonl"
        try:
            with path.open("rb") as file:
                file.seek(self._metrics_offset)
                chunk = file.read()
        except FileNotFoundError:
            return
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next call
        self._metrics_offset += len(complete)
        self._metrics += [orjson.loads(line) for line in complete.splitlines() if line.strip()]

    # ---- what the pages ask ----------------------------------------------------------------

    def metrics(self, after: int = 0) -> list[dict[str, Any]]:
        with self._lock:
            return self._metrics[after:]

    def counts(self) -> dict[str, Any]:
        with self._lock:
            total, steps = self._db.execute("SELECT COUNT(*), MAX(step) FROM samples").fetchone()
            by_status = dict(self._db.execute("SELECT status, COUNT(*) FROM samples GROUP BY status").fetchall())
        return {"samples": total, "last_step": steps, "by_status": by_status}

    def page(self, query: SampleQuery) -> dict[str, Any]:
        """One sorted, filtered page of Sample summaries, and how many match."""
        where, args = query.clauses()
        order = "DESC" if query.descending else "ASC"
        # One direction throughout, so that the column's index is walked instead of every match sorted;
        # unknown values (a Sample not yet trained has no mismatch) come first ascending, last descending.
        keys = dict.fromkeys((query.sort, "group_index", "sample_index", "branch"))
        sort = ", ".join(f"{column} {order}" for column in keys)
        with self._lock:
            total = self._db.execute(f"SELECT COUNT(*) FROM samples{where}", args).fetchone()[0]
            rows = self._db.execute(
                f"SELECT {', '.join(COLUMNS)} FROM samples{where} ORDER BY {sort} LIMIT ? OFFSET ?",
                [*args, query.page_size, query.page * query.page_size],
            ).fetchall()
        return {
            "total": total,
            "page": query.page,
            "page_size": query.page_size,
            "rows": [dict(zip(COLUMNS, row)) for row in rows],
        }

    def _rows(self, where: str, args: tuple) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute(
                f"SELECT {', '.join(COLUMNS)}, sibling FROM samples WHERE {where} ORDER BY sample_index, branch", args
            ).fetchall()
        return [dict(zip((*COLUMNS, "sibling"), row)) for row in rows]

    def trajectory(self, group_index: int, sample_index: int, branch: int) -> dict[str, Any] | None:
        """One Sample token by token, its session's branches with their fork points, and its group."""
        session = self._rows("group_index = ? AND sample_index = ?", (group_index, sample_index))
        me = next((row for row in session if row["branch"] == branch), None)
        blob = self.archive.sample(group_index, sample_index) if me else None
        if blob is None:
            return None
        stored = orjson.loads(blob)
        siblings = (stored.get("metadata") or {}).get("siblings") or []
        branch_data = {
            row["branch"]: stored if row["sibling"] < 0 else siblings[row["sibling"]]
            for row in session
            if row["sibling"] < len(siblings)
        }
        data = branch_data[branch]
        tokens = data["tokens"]
        for row in session:
            other = branch_data.get(row["branch"], {}).get("tokens", [])
            row["fork_at"] = fork = common_prefix(tokens, other)
            texts = self.texts(other[fork:])
            row["after_fork"] = "".join(texts) if texts is not None else " ".join(map(str, other[fork:]))
        detail = self.details.get(group_index, sample_index, branch)
        metadata = {k: v for k, v in (data.get("metadata") or {}).items() if k != "siblings"}
        return {
            "summary": me,
            "prompt": data.get("prompt"),
            "label": data.get("label"),
            "reward": data.get("reward"),
            "status": data.get("status"),
            "session_id": data.get("session_id"),
            "metadata": metadata,
            "tokens": tokens,
            "text": self.texts(tokens),
            "prompt_length": len(tokens) - data["response_length"],
            "loss_mask": data["loss_mask"],
            "rollout_log_probs": data["rollout_log_probs"],
            "weight_versions": data["weight_versions"],
            "train_log_probs": detail.log_probs.tolist() if detail else None,
            "advantages": detail.advantages.tolist() if detail else None,
            "routed_experts": self._experts(data.get("rollout_routed_experts")),
            # each response token's kept-set size under top-p/top-k (0: the whole vocabulary); None: none recorded
            "kept_set_sizes": [b - a for a, b in zip(offsets, offsets[1:])]
            if (offsets := data.get("rollout_top_p_token_offsets"))
            else None,
            "turns": metadata.get("turns") or [],
            "branches": session,
            "group": self._rows("group_index = ?", (group_index,)),
        }

    def texts(self, ids: list[int]) -> list[str] | None:
        """Each token's text (byte-level pieces decoded on their own); None without a tokenizer."""
        if self.tokenizer is None:
            return None
        missing = sorted(set(ids) - self._texts.keys())
        if missing:
            pieces = self.tokenizer.convert_ids_to_tokens(missing)
            self._texts.update(
                (i, self.tokenizer.convert_tokens_to_string([p]) if p is not None else f"<{i}>")
                for i, p in zip(missing, pieces)
            )
        return [self._texts[i] for i in ids]

    def _experts(self, encoded: str | None) -> list[list[list[int]]] | None:
        """Routed experts per token ``[tokens - 1][layers][top_k]``, when recorded and the model's shape is known."""
        if not encoded or self.experts_shape is None:
            return None
        return decode_routed_experts(encoded).reshape(-1, *self.experts_shape).tolist()

    def close(self) -> None:
        self.archive.close()
        self._db.close()


SUMMARY = (
    "group_index",
    "sample_index",
    "branch",
    "sibling",
    "reward",
    "response_length",
    "prompt_length",
    "status",
    "turns",
    "branches",
    "version_min",
    "version_max",
)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
