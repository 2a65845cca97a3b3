"""The buffer's durable state: prompts, groups, tasks and samples in one SQLite file (no HTTP here).

Life of a group: the dataset cursor turns the next prompt into a group of
``n_samples_per_prompt`` *tasks* (one per sample). Workers *lease* tasks; a lease is an
unguessable id with an expiry, and only the current lease of a task may complete it: when a
lease expires the task goes back to the queue, and once it is leased again the old lease is
void, so a task yields exactly one sample. A group whose tasks are all done is *complete*;
``next_batch`` serves complete groups oldest first, dropping or re-sampling those past the
staleness bound and those the filter rejects, and marks what it serves *consumed*.

Every state change is one transaction (``BEGIN IMMEDIATE`` … ``COMMIT``) in WAL mode with
``synchronous=FULL``: a call that returned has reached the disk, and a killed process loses only
calls that had not returned. Lease and batch calls may carry a ``request_id``; a repeated id
replays the recorded answer, so a client's retry never leases or consumes twice. A lease's
``request_id`` is its worker's: another worker naming it is a new lease, never a replay of the
first worker's lease ids. A worker id is the worker's credential among the holders of the
buffer's key (``release`` gives back what the named worker holds), so it should be unguessable.
Submissions are idempotent by (group_index, index).

Weight versions are the trainer's step as a decimal string (``types.version_number``).
"""

from __future__ import annotations

import hashlib
import secrets
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Literal

import orjson

from inverted.buffer.datasets import PromptRecord, epoch_order
from inverted.buffer.filters import GroupChooser, GroupFilter
from inverted.errors import ConfigError, LeaseConflict, SampleError
from inverted.types import Sample, Task, unfold_siblings, version_number

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS prompts (prompt_index INTEGER PRIMARY KEY, record BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS groups (
    group_index INTEGER PRIMARY KEY, prompt_index INTEGER NOT NULL, epoch INTEGER NOT NULL,
    state TEXT NOT NULL, min_version INTEGER, staleness INTEGER, batch_id TEXT,
    created_at REAL NOT NULL, completed_at REAL, consumed_at REAL, trained_step INTEGER);
CREATE INDEX IF NOT EXISTS groups_by_state ON groups (state, group_index);
CREATE TABLE IF NOT EXISTS tasks (
    group_index INTEGER NOT NULL, sample_index INTEGER NOT NULL, state TEXT NOT NULL,
    lease_id TEXT, worker_id TEXT, lease_expires REAL, attempts INTEGER NOT NULL DEFAULT 0,
    partial BLOB, PRIMARY KEY (group_index, sample_index));
CREATE INDEX IF NOT EXISTS tasks_by_state ON tasks (state, lease_expires);
CREATE TABLE IF NOT EXISTS samples (
    group_index INTEGER NOT NULL, sample_index INTEGER NOT NULL, sample BLOB NOT NULL,
    min_version INTEGER, failed INTEGER NOT NULL, rollout_id INTEGER, size INTEGER NOT NULL DEFAULT 1,
    PRIMARY KEY (group_index, sample_index));  -- size: the task's Samples, its fan-out included
CREATE TABLE IF NOT EXISTS replies (request_id TEXT PRIMARY KEY, kind TEXT NOT NULL, reply BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""

GROUP_STATES = ("open", "complete", "consumed", "dropped_stale", "filtered", "failed")
TASK_STATES = ("queued", "leased", "done")


def batch_ref(batch_id: str | None, sizes: list[int], staleness: list[int]) -> bytes:
    """A served batch by reference: its id, and each group's size (its Samples, a task's fan-out
    included) and staleness, without its Samples."""
    return orjson.dumps({"batch_id": batch_id, "groups": [], "sizes": sizes, "staleness": staleness})


def by_reference(reply: bytes) -> bytes:
    """A stored batch (with its Samples) by reference (parsed: only a batch served again pays for it)."""
    batch = orjson.loads(reply)
    sizes = [sum(1 + len((s.get("metadata") or {}).get("siblings") or []) for s in group) for group in batch["groups"]]
    return batch_ref(batch["batch_id"], sizes, batch["staleness"])


def decoded(blobs: list[bytes]) -> list[Sample]:
    """A group's stored Samples as a plug-in sees them: a task's fan-out as Samples of their own."""
    return unfold_siblings([Sample.from_json(b) for b in blobs])


@dataclass(slots=True)
class SubmitResult:
    accepted: int = 0
    duplicates: int = 0
    requeued: int = 0
    completed_groups: list[int] = field(default_factory=list)


class SQLiteStore:
    """The buffer's storage: one SQLite file. Thread-safe: calls are serialised by a lock."""

    def __init__(
        self,
        path: str,
        *,
        n_samples_per_prompt: int,
        prompts: list[PromptRecord] | None = None,
        shuffle: bool = False,
        seed: int = 42,
        num_epoch: int = 0,
        partial_rollout: bool = False,
        stale_policy: Literal["drop", "retry"] = "drop",
        group_filter: GroupFilter | None = None,
        group_chooser: GroupChooser | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.n = n_samples_per_prompt
        self.shuffle, self.seed, self.num_epoch = shuffle, seed, num_epoch
        self.partial_rollout, self.stale_policy, self.group_filter = partial_rollout, stale_policy, group_filter
        self.group_chooser = group_chooser
        self.clock = clock
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        for pragma in ("journal_mode=WAL", "synchronous=FULL", "busy_timeout=10000"):
            self._db.execute(f"PRAGMA {pragma}")
        self._db.executescript(SCHEMA)
        for table, column in (
            ("groups", "trained_step INTEGER"),
            ("samples", "rollout_id INTEGER"),
            ("samples", "size INTEGER NOT NULL DEFAULT 1"),
        ):  # a file from before they were kept
            if column.split()[0] not in {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column}")
        with self._tx():
            self._init_meta(prompts)
        self.num_prompts = self._db.execute(  # the dataset's: not the prompts of recorded groups (epoch -1)
            "SELECT COUNT(*) FROM prompts WHERE prompt_index NOT IN (SELECT prompt_index FROM groups WHERE epoch = -1)"
        ).fetchone()[0]
        self._orders: dict[int, list[int]] = {}

    # ---- setup ---------------------------------------------------------------------------

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def _counter(self, key: str) -> int:
        """One of the counters ``_init_meta`` sets (the dataset's epoch and offset, the next group)."""
        value = self._meta(key)
        if value is None:
            raise RuntimeError(f"the buffer file has no {key!r}: it was not made by this store")
        return int(value)

    def _set_meta(self, key: str, value: Any) -> None:
        self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, str(value)))

    def _init_meta(self, prompts: list[PromptRecord] | None) -> None:
        stored_n = self._meta("n_samples_per_prompt")
        if stored_n is not None and int(stored_n) != self.n:
            raise ConfigError(f"--n-samples-per-prompt={self.n}: this database was made with {stored_n}")
        self._set_meta("n_samples_per_prompt", self.n)
        for key, value in (("epoch", 0), ("offset", 0), ("next_group", 0)):
            if self._meta(key) is None:
                self._set_meta(key, value)
        if prompts is None:
            return
        blobs = [orjson.dumps(p.to_json()) for p in prompts]
        fingerprint = hashlib.sha256(b"\n".join(blobs)).hexdigest()
        stored = self._meta("dataset_sha256")
        if stored is None:
            self._db.executemany("INSERT INTO prompts (prompt_index, record) VALUES (?, ?)", enumerate(blobs))
            self._set_meta("dataset_sha256", fingerprint)
        elif stored != fingerprint:
            raise ConfigError("--prompt-data differs from the dataset this database was made with; use a new --db")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ---- counters and replies ------------------------------------------------------------

    def _count(self, name: str, by: int = 1) -> None:
        if by:
            self._db.execute(
                "INSERT INTO counters (name, value) VALUES (?, ?) "
                "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
                (name, by),
            )

    def _replay(self, request_id: str | None, kind: str) -> bytes | None:
        if request_id is None:
            return None
        row = self._db.execute("SELECT kind, reply FROM replies WHERE request_id = ?", (request_id,)).fetchone()
        if row and row[0] != kind:
            raise SampleError(f"request_id {request_id!r} was already used for a {row[0]} call")
        return row[1] if row else None

    def _record(self, request_id: str | None, kind: str, reply: bytes) -> None:
        if request_id is not None:
            self._db.execute(
                "INSERT INTO replies (request_id, kind, reply) VALUES (?, ?, ?)", (request_id, kind, reply)
            )

    # ---- leasing -------------------------------------------------------------------------

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            self._orders = {epoch: epoch_order(self.num_prompts, self.seed, epoch, self.shuffle)}
        return self._orders[epoch]

    def _open_group(self, now: float) -> bool:
        """Turn the next prompt into a group of queued tasks; False when the epochs are used up."""
        if self.num_prompts == 0:
            return False
        epoch, offset = self._counter("epoch"), self._counter("offset")
        if self.num_epoch and epoch >= self.num_epoch:
            return False
        group = self._counter("next_group")
        prompt_index = self._order(epoch)[offset]
        self._db.execute(
            "INSERT INTO groups (group_index, prompt_index, epoch, state, created_at) VALUES (?, ?, ?, 'open', ?)",
            (group, prompt_index, epoch, now),
        )
        self._db.executemany(
            "INSERT INTO tasks (group_index, sample_index, state) VALUES (?, ?, 'queued')",
            [(group, i) for i in range(self.n)],
        )
        offset += 1
        if offset == self.num_prompts:
            epoch, offset = epoch + 1, 0
        self._set_meta("epoch", epoch)
        self._set_meta("offset", offset)
        self._set_meta("next_group", group + 1)
        return True

    def lease(self, count: int, worker_id: str, lease_seconds: float, request_id: str | None = None) -> list[dict]:
        """Up to ``count`` tasks: re-queued ones first, then new groups from the dataset."""
        request_id = None if request_id is None else f"{worker_id}\x00{request_id}"  # the worker's own
        with self._tx() as db:
            replay = self._replay(request_id, "lease")
            if replay is not None:
                return orjson.loads(replay)
            now = self.clock()
            expired = db.execute(
                "UPDATE tasks SET state = 'queued', worker_id = NULL WHERE state = 'leased' AND lease_expires <= ?",
                (now,),
            ).rowcount
            self._count("leases_expired", expired)
            queued = db.execute("SELECT COUNT(*) FROM tasks WHERE state = 'queued'").fetchone()[0]
            while queued < count and self._open_group(now):
                queued += self.n
            rows = db.execute(
                "SELECT group_index, sample_index FROM tasks WHERE state = 'queued' "
                "ORDER BY group_index, sample_index LIMIT ?",
                (count,),
            ).fetchall()
            leased = []
            for group, index in rows:
                lease_id = secrets.token_urlsafe(18)
                db.execute(
                    "UPDATE tasks SET state = 'leased', lease_id = ?, worker_id = ?, lease_expires = ?, "
                    "attempts = attempts + 1 WHERE group_index = ? AND sample_index = ?",
                    (lease_id, worker_id, now + lease_seconds, group, index),
                )
                prompt_index, record, attempts, partial = db.execute(
                    "SELECT g.prompt_index, p.record, t.attempts, t.partial "
                    "FROM tasks t JOIN groups g USING (group_index) JOIN prompts p USING (prompt_index) "
                    "WHERE t.group_index = ? AND t.sample_index = ?",
                    (group, index),
                ).fetchone()
                leased.append(
                    Task(
                        lease_id=lease_id,
                        group_index=group,
                        index=index,
                        prompt_index=prompt_index,
                        **orjson.loads(record),
                        expires_at=now + lease_seconds,
                        attempt=attempts,
                        partial=Sample.from_json(partial) if partial else None,
                    ).to_json()
                )
            self._count("tasks_leased", len(leased))
            self._record(request_id, "lease", orjson.dumps(leased))
            return leased

    def release(self, worker_id: str) -> int:
        """Put every task ``worker_id`` holds back in the queue, its leases void (a worker that stopped
        or restarted gives its tasks back at once instead of letting the leases run out); how many."""
        with self._tx() as db:
            released = db.execute(
                "UPDATE tasks SET state = 'queued', lease_id = NULL, worker_id = NULL "
                "WHERE state = 'leased' AND worker_id = ?",
                (worker_id,),
            ).rowcount
            self._count("leases_released", released)
        return released

    # ---- submitting ----------------------------------------------------------------------

    def submit(self, items: list[tuple[str, Sample]], encoded: list[bytes] | None = None) -> SubmitResult:
        """Record samples for leased tasks, all or nothing; a sample already recorded is a duplicate.

        ``encoded[i]``, when given, is item i's Sample as JSON already (the service passes the bytes
        it received) and is stored instead of encoding the Sample again. Encoding happens before the
        transaction, and the writes are batched, so the write lock is held briefly (other service
        processes wait on it).
        """
        keys: list[tuple[int, int]] = []
        for position, (_, sample) in enumerate(items):
            if sample.group_index is None or sample.index is None:
                raise SampleError(f"samples[{position}]: group_index and index are required")
            keys.append((sample.group_index, sample.index))
        blobs = encoded if encoded is not None else [orjson.dumps(s.to_json()) for _, s in items]
        lowest = [min(map(version_number, set(s.weight_versions)), default=None) for _, s in items]
        result = SubmitResult()
        with self._tx() as db:
            rows: list[tuple[Any, ...]] = []
            done: list[tuple[int, int]] = []
            touched: set[int] = set()
            for position, ((lease_id, sample), key) in enumerate(zip(items, keys)):
                where = f"samples[{position}]"
                task = db.execute(
                    "SELECT t.lease_id, s.sample_index IS NOT NULL FROM tasks t LEFT JOIN samples s "
                    "USING (group_index, sample_index) WHERE t.group_index = ? AND t.sample_index = ?",
                    key,
                ).fetchone()
                if task is None:
                    raise SampleError(f"{where}.group_index: unknown group/index {key}")
                if task[1] or key in done:
                    result.duplicates += 1
                    continue
                if task[0] != lease_id:
                    raise LeaseConflict(
                        f"{where}: lease {lease_id!r} is not the current lease of task {key} "
                        "(it expired and was leased again)"
                    )
                if sample.status in (Sample.Status.ABORTED, Sample.Status.PENDING):
                    keep = blobs[position] if self.partial_rollout and sample.response_length else None
                    db.execute(
                        "UPDATE tasks SET state = 'queued', lease_id = NULL, worker_id = NULL, partial = ? "
                        "WHERE group_index = ? AND sample_index = ?",
                        (keep, *key),
                    )
                    self._count("samples_requeued_partial" if keep else "samples_requeued_aborted")
                    result.requeued += 1
                    continue
                rows.append(
                    (
                        *key,
                        blobs[position],
                        lowest[position],
                        sample.status == Sample.Status.FAILED,
                        sample.metadata.get("rollout_id"),
                        1 + len(sample.metadata.get("siblings") or []),
                    )
                )
                done.append(key)
                touched.add(key[0])
            db.executemany(
                "INSERT INTO samples (group_index, sample_index, sample, min_version, failed, rollout_id, size) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
            db.executemany(
                "UPDATE tasks SET state = 'done', partial = NULL WHERE group_index = ? AND sample_index = ?", done
            )
            result.accepted = len(rows)
            for group in sorted(touched):
                if self._complete_group(group):
                    result.completed_groups.append(group)
            self._count("samples_accepted", result.accepted)
            self._count("samples_duplicate", result.duplicates)
        return result

    def record(self, prompt: PromptRecord, samples: list[Sample], batch_id: str) -> int:
        """A group sampled outside the task flow, stored as served; its group index.

        For a caller that drives its own loop (``inverted tinker-serve``) and keeps what it sampled as a
        job keeps it, for ``inverted view``: the prompt joins the prompts table after any dataset's
        (epoch -1: no epoch leases it), the group is consumed at once under ``batch_id``, and its
        samples take indices 0.. in order. One transaction: all of it is stored, or none.
        """
        blob = orjson.dumps(prompt.to_json())
        lowest = [min(map(version_number, set(s.weight_versions)), default=None) for s in samples]
        with self._tx() as db:
            now = self.clock()
            group = self._counter("next_group")
            prompt_index = db.execute("SELECT COALESCE(MAX(prompt_index) + 1, 0) FROM prompts").fetchone()[0]
            db.execute("INSERT INTO prompts (prompt_index, record) VALUES (?, ?)", (prompt_index, blob))
            db.execute(
                "INSERT INTO groups (group_index, prompt_index, epoch, state, min_version, staleness, batch_id, "
                "created_at, completed_at, consumed_at) VALUES (?, ?, -1, 'consumed', ?, 0, ?, ?, ?, ?)",
                (group, prompt_index, min((v for v in lowest if v is not None), default=None), batch_id, now, now, now),
            )
            db.executemany(
                "INSERT INTO tasks (group_index, sample_index, state, attempts) VALUES (?, ?, 'done', 1)",
                [(group, i) for i in range(len(samples))],
            )
            db.executemany(
                "INSERT INTO samples (group_index, sample_index, sample, min_version, failed) VALUES (?, ?, ?, ?, ?)",
                [
                    (
                        group,
                        i,
                        orjson.dumps(replace(sample, group_index=group, index=i).to_json()),
                        lowest[i],
                        sample.status == Sample.Status.FAILED,
                    )
                    for i, sample in enumerate(samples)
                ],
            )
            self._set_meta("next_group", group + 1)
            self._count("groups_recorded")
            self._count("samples_accepted", len(samples))
        return group

    def _complete_group(self, group: int) -> bool:
        done, min_version, failed = self._db.execute(
            "SELECT COUNT(*), MIN(min_version), MAX(failed) FROM samples WHERE group_index = ?", (group,)
        ).fetchone()
        if done < self.n:
            return False
        self._db.execute(
            "UPDATE groups SET state = ?, min_version = ?, completed_at = ? WHERE group_index = ?",
            ("failed" if failed else "complete", min_version, self.clock(), group),
        )
        if failed:
            self._count("groups_failed")
        return True

    # ---- batches -------------------------------------------------------------------------

    def next_batch(
        self,
        num_groups: int,
        current_version: int | None,
        max_staleness: int | None,
        request_id: str | None = None,
        allow_partial: bool = False,
        samples: bool = True,
    ) -> bytes | None:
        """Serve ``num_groups`` complete groups as JSON (by reference, without their Samples, unless
        ``samples``), or None (nothing consumed) if too few qualify.

        Groups past the staleness bound are dropped or re-sampled, and groups the filter rejects
        are set aside, as they are met, oldest first; those decisions stand even if no batch is served.
        """
        with self._tx() as db:
            replay = self._replay(request_id, "batch")
            if replay is not None:
                return replay if samples else by_reference(replay)
            accepted: list[tuple[int, int, list[bytes], int]] = []  # group, staleness, its tasks, its Samples
            for group, min_version in db.execute(
                "SELECT group_index, min_version FROM groups WHERE state = 'complete' ORDER BY group_index"
            ).fetchall():
                if len(accepted) == num_groups and self.group_chooser is None:  # a chooser sees every waiting group
                    break
                staleness = (
                    0 if current_version is None or min_version is None else max(0, current_version - min_version)
                )
                if max_staleness is not None and staleness > max_staleness:
                    self._set_aside_stale(group)
                    continue
                rows = db.execute(
                    "SELECT sample, size FROM samples WHERE group_index = ? ORDER BY sample_index", (group,)
                ).fetchall()
                blobs = [b for b, _ in rows]
                if self.group_filter is not None and not self.group_filter(decoded(blobs)):
                    db.execute("UPDATE groups SET state = 'filtered' WHERE group_index = ?", (group,))
                    self._count("groups_filtered")
                    continue
                accepted.append((group, staleness, blobs, sum(size for _, size in rows)))
            if self.group_chooser is not None and accepted:
                chosen = self.group_chooser(
                    [decoded(blobs) for _, _, blobs, _ in accepted], num_groups, current_version
                )
                accepted = [accepted[i] for i in chosen][:num_groups]
            if not accepted or (len(accepted) < num_groups and not allow_partial):
                return None
            batch_id = secrets.token_hex(8)
            now = self.clock()
            db.executemany(
                "UPDATE groups SET state = 'consumed', staleness = ?, batch_id = ?, consumed_at = ? "
                "WHERE group_index = ?",
                [(staleness, batch_id, now, group) for group, staleness, _, _ in accepted],
            )
            self._count("groups_consumed", len(accepted))
            reply = orjson.dumps(
                {
                    "batch_id": batch_id,
                    "groups": [[orjson.Fragment(b) for b in blobs] for _, _, blobs, _ in accepted],
                    "staleness": [s for _, s, _, _ in accepted],
                }
            )
            self._record(request_id, "batch", reply)
            if samples:
                return reply
            return batch_ref(batch_id, [size for *_, size in accepted], [s for _, s, _, _ in accepted])

    def served_batch(self, request_id: str, samples: bool = True) -> bytes | None:
        """The batch ``next_batch`` served under ``request_id``, if it served one (nothing is consumed)."""
        with self._lock:
            reply = self._replay(request_id, "batch")
        return reply if reply is None or samples else by_reference(reply)

    def trained(self, batch_id: str, step: int) -> int:
        """Record that training step ``step`` trained batch ``batch_id``; how many groups it held (0: no
        such batch was served).

        Said again for the same step (a resumed job trains the step its dead run was served for),
        it changes nothing. A batch already trained in another step is refused: that would be
        training it twice.
        """
        with self._tx() as db:
            rows = db.execute("SELECT group_index, trained_step FROM groups WHERE batch_id = ?", (batch_id,)).fetchall()
            if not rows:
                return 0
            if other := sorted({t for _, t in rows if t is not None and t != step}):
                raise LeaseConflict(
                    f"batch {batch_id!r} was trained in step {other[0]} already, not again in step {step}"
                )
            fresh = sum(t is None for _, t in rows)
            db.execute("UPDATE groups SET trained_step = ? WHERE batch_id = ?", (step, batch_id))
            self._count("groups_trained", fresh)
            return len(rows)

    def _set_aside_stale(self, group: int) -> None:
        if self.stale_policy == "drop":
            self._db.execute("UPDATE groups SET state = 'dropped_stale' WHERE group_index = ?", (group,))
            self._count("groups_dropped_stale")
            return
        self._db.execute("DELETE FROM samples WHERE group_index = ?", (group,))
        self._db.execute(
            "UPDATE tasks SET state = 'queued', lease_id = NULL, worker_id = NULL, partial = NULL "
            "WHERE group_index = ?",
            (group,),
        )
        self._db.execute(
            "UPDATE groups SET state = 'open', min_version = NULL, completed_at = NULL WHERE group_index = ?", (group,)
        )
        self._count("groups_retried_stale")

    # ---- observing -----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        with self._lock:
            db = self._db
            groups = dict.fromkeys(GROUP_STATES, 0) | dict(
                db.execute("SELECT state, COUNT(*) FROM groups GROUP BY state").fetchall()
            )
            tasks = dict.fromkeys(TASK_STATES, 0) | dict(
                db.execute("SELECT state, COUNT(*) FROM tasks GROUP BY state").fetchall()
            )
            histogram = {
                str(k): v
                for k, v in db.execute(
                    "SELECT staleness, COUNT(*) FROM groups WHERE state = 'consumed' "
                    "GROUP BY staleness ORDER BY staleness"
                )
            }
            return {
                "groups": groups,
                "tasks": tasks,
                "samples": db.execute("SELECT COUNT(*) FROM samples").fetchone()[0],
                "staleness_histogram": histogram,
                "counters": dict(db.execute("SELECT name, value FROM counters").fetchall()),
                "dataset": {
                    "prompts": self.num_prompts,
                    "epoch": self._counter("epoch"),
                    "offset": self._counter("offset"),
                    "n_samples_per_prompt": self.n,
                },
            }
