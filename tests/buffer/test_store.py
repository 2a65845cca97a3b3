"""``SQLiteStore`` in-process on a real SQLite file: leases, groups, batches, staleness, resume."""

from __future__ import annotations

import json
import sqlite3

import orjson
import pytest

from inverted.buffer.datasets import PromptRecord, epoch_order, load_prompts
from inverted.buffer.filters import drop_all_equal_rewards
from inverted.buffer.store import SQLiteStore
from inverted.errors import ConfigError, LeaseConflict, SampleError
from inverted.types import Sample

PROMPTS = [PromptRecord(prompt=f"What is {i} + {i}?", label=str(2 * i), metadata={"i": i}) for i in range(10)]


class Clock:
    """The store's time source, advanced by hand (the store takes a clock, so no sleeping)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(directory, **kwargs) -> SQLiteStore:
    directory.mkdir(parents=True, exist_ok=True)
    kwargs.setdefault("n_samples_per_prompt", 2)
    kwargs.setdefault("prompts", PROMPTS)
    return SQLiteStore(str(directory / "buffer.db"), **kwargs)


def finished(
    task: dict, *, version: str = "0", reward: float = 1.0, status=Sample.Status.COMPLETED
) -> tuple[str, Sample]:
    sample = Sample(
        group_index=task["group_index"],
        index=task["index"],
        prompt=task["prompt"],
        tokens=[1, 2, 3, 4],
        response_length=2,
        loss_mask=[1, 1],
        rollout_log_probs=[-0.5, -0.25],
        weight_versions=[version, version],
        reward=reward,
        status=status,
    )
    return task["lease_id"], sample


def batch(store, n, **kwargs):
    reply = store.next_batch(n, kwargs.pop("current", None), kwargs.pop("max_staleness", None), **kwargs)
    return None if reply is None else orjson.loads(reply)


def test_groups_follow_the_dataset_and_complete_only_when_full(tmp_path):
    store = make(tmp_path)
    tasks = store.lease(5, "w", 60)
    assert [(t["group_index"], t["index"]) for t in tasks] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    assert [t["prompt"] for t in tasks[::2]] == ["What is 0 + 0?", "What is 1 + 1?", "What is 2 + 2?"]
    assert tasks[0]["label"] == "0" and tasks[0]["metadata"] == {"i": 0} and len(tasks[0]["lease_id"]) >= 24
    store.submit([finished(tasks[0]), finished(tasks[2]), finished(tasks[3]), finished(tasks[4])])
    got = batch(store, 5, allow_partial=True)
    assert [[s["group_index"] for s in g] for g in got["groups"]] == [[1, 1]]  # group 0 and 2 are not complete
    assert batch(store, 1) is None  # consumed groups are never served again
    store.submit([finished(tasks[1])])
    assert [s["index"] for s in batch(store, 1)["groups"][0]] == [0, 1]
    stats = store.stats()
    assert stats["groups"]["consumed"] == 2 and stats["groups"]["open"] == 1 and stats["samples"] == 5


def test_batch_waits_for_enough_groups_unless_partial(tmp_path):
    store = make(tmp_path)
    tasks = store.lease(2, "w", 60)
    store.submit([finished(t) for t in tasks])
    assert batch(store, 2) is None
    assert store.stats()["groups"]["complete"] == 1  # nothing was consumed by the refused call
    assert len(batch(store, 2, allow_partial=True)["groups"]) == 1


def test_expired_leases_are_reissued_and_the_old_lease_is_void(tmp_path):
    clock = Clock()
    store = make(tmp_path, clock=clock)
    first = store.lease(2, "dead-worker", 30)
    clock.now += 31
    second = store.lease(2, "live-worker", 30)
    assert [(t["group_index"], t["index"]) for t in second] == [(0, 0), (0, 1)]
    assert second[0]["attempt"] == 2 and second[0]["lease_id"] != first[0]["lease_id"]
    with pytest.raises(LeaseConflict, match="not the current lease"):
        store.submit([finished(first[0])])
    store.submit([finished(t) for t in second])
    assert store.stats()["counters"]["leases_expired"] == 2
    # A late duplicate from anyone is acknowledged and changes nothing.
    assert store.submit([finished(second[0])]).duplicates == 1
    assert store.stats()["samples"] == 2


def test_a_worker_gives_its_leases_back_at_once(tmp_path):
    """A job that restarts (or stops) returns its tasks instead of waiting out their leases."""
    store = make(tmp_path, partial_rollout=True)
    crashed, other = store.lease(2, "controller", 600), store.lease(2, "other", 600)
    aborted = finished(crashed[0], status=Sample.Status.ABORTED)
    store.submit([aborted])  # an aborted sample keeps its tokens for the next lessee
    crashed = [crashed[1], *store.lease(1, "controller", 600)]
    assert store.release("controller") == 2 and store.release("controller") == 0
    with pytest.raises(LeaseConflict):  # the old leases are void
        store.submit([finished(crashed[1])])
    again = store.lease(4, "controller", 600)
    assert [(t["group_index"], t["index"]) for t in again] == [(0, 0), (0, 1), (2, 0), (2, 1)]
    assert again[0]["partial"]["tokens"] == aborted[1].tokens  # the partial rollout survived the release
    store.submit([finished(t) for t in other])  # the other worker's leases are untouched
    assert store.stats()["counters"]["leases_released"] == 2


def test_a_lease_request_id_is_its_workers_own(tmp_path):
    """The audit: replaying another worker's request_id returned that worker's lease ids."""
    store = make(tmp_path)
    first = store.lease(2, "worker-a", 600, request_id="r1")
    assert store.lease(2, "worker-a", 600, request_id="r1") == first  # a's retry: the same leases
    other = store.lease(2, "worker-b", 600, request_id="r1")  # b naming a's id: leases of its own
    assert {t["lease_id"] for t in other}.isdisjoint(t["lease_id"] for t in first)
    store.submit([finished(t) for t in first + other])


def test_the_jobs_worker_id_is_unguessable_and_survives_a_restart(tmp_path):
    from inverted.controller.job import _worker_id

    first = _worker_id(tmp_path)
    assert first.startswith("controller-") and len(first) > 30 and _worker_id(tmp_path) == first
    assert (tmp_path / "services" / "worker_id").stat().st_mode & 0o077 == 0
    assert _worker_id(tmp_path / "another") != first


def test_a_submission_is_all_or_nothing(tmp_path):
    store = make(tmp_path)
    tasks = store.lease(2, "w", 60)
    bogus = Sample(group_index=99, index=0, tokens=[1], response_length=0)
    with pytest.raises(SampleError, match=r"samples\[1\].group_index: unknown group"):
        store.submit([finished(tasks[0]), ("x", bogus)])
    assert store.stats()["samples"] == 0 and store.stats()["tasks"]["leased"] == 2


def test_staleness_drop_and_retry(tmp_path):
    for policy in ("drop", "retry"):
        store = make(tmp_path / policy, stale_policy=policy)
        tasks = store.lease(4, "w", 60)
        store.submit(
            [
                finished(tasks[0], version="3"),
                finished(tasks[1], version="5"),
                finished(tasks[2], version="6"),
                finished(tasks[3], version="6"),
            ]
        )
        got = batch(store, 1, current=7, max_staleness=2)  # group 0 is 4 steps old (its oldest token)
        assert [s["group_index"] for s in got["groups"][0]] == [1, 1] and got["staleness"] == [1]
        stats = store.stats()
        if policy == "drop":
            assert stats["groups"]["dropped_stale"] == 1 and stats["counters"]["groups_dropped_stale"] == 1
        else:
            assert stats["groups"]["open"] == 1 and stats["counters"]["groups_retried_stale"] == 1
            again = store.lease(2, "w", 60)
            assert [(t["group_index"], t["index"]) for t in again] == [(0, 0), (0, 1)]
        assert stats["staleness_histogram"] == {"1": 1}


def test_all_equal_rewards_filter(tmp_path):
    store = make(tmp_path, group_filter=drop_all_equal_rewards)
    tasks = store.lease(4, "w", 60)
    store.submit(
        [
            finished(tasks[0], reward=1.0),
            finished(tasks[1], reward=1.0),
            finished(tasks[2], reward=0.0),
            finished(tasks[3], reward=1.0),
        ]
    )
    got = batch(store, 1)
    assert [s["group_index"] for s in got["groups"][0]] == [1, 1]
    assert store.stats()["groups"]["filtered"] == 1 and store.stats()["counters"]["groups_filtered"] == 1


def test_aborted_samples_requeue_with_or_without_their_tokens(tmp_path):
    for partial in (False, True):
        store = make(tmp_path / str(partial), partial_rollout=partial)
        task = store.lease(1, "w", 60)[0]
        lease, sample = finished(task, status=Sample.Status.ABORTED, version="4")
        assert store.submit([(lease, sample)]).requeued == 1
        again = store.lease(1, "w2", 60)[0]
        assert (again["group_index"], again["index"]) == (0, 0)
        if partial:
            assert again["partial"]["tokens"] == [1, 2, 3, 4] and again["partial"]["weight_versions"] == ["4", "4"]
        else:
            assert again["partial"] is None
        with pytest.raises(LeaseConflict):
            store.submit([(lease, finished(task)[1])])


def test_failed_samples_fail_their_group(tmp_path):
    store = make(tmp_path)
    tasks = store.lease(2, "w", 60)
    store.submit([finished(tasks[0]), finished(tasks[1], status=Sample.Status.FAILED)])
    assert batch(store, 1) is None
    assert store.stats()["groups"]["failed"] == 1


def test_resume_continues_the_same_order_and_replays_requests(tmp_path):
    reference = make(tmp_path / "a", shuffle=True, seed=7)
    expected = [t["prompt_index"] for t in reference.lease(50, "w", 60)[::2]]
    assert expected[:10] == epoch_order(10, 7, 0, True) and expected[10:20] == epoch_order(10, 7, 1, True)
    assert expected[:10] != expected[10:20]  # each epoch has its own permutation

    store = make(tmp_path / "b", shuffle=True, seed=7)
    seen = [t["prompt_index"] for t in store.lease(14, "w", 60, request_id="r1")[::2]]
    replay = store.lease(14, "w", 60, request_id="r1")
    assert [t["prompt_index"] for t in replay[::2]] == seen  # a retried call gets the same answer
    store.close()
    store = make(tmp_path / "b", shuffle=True, seed=7)  # restart on the same file
    seen += [t["prompt_index"] for t in store.lease(36, "w", 60)[::2]]
    assert seen == expected
    with pytest.raises(ConfigError, match="n-samples-per-prompt"):
        make(tmp_path / "b", n_samples_per_prompt=3)
    with pytest.raises(ConfigError, match="differs from the dataset"):
        make(tmp_path / "b", prompts=PROMPTS[:5])


def test_a_batch_is_recorded_trained_by_one_step_only(tmp_path):
    store = make(tmp_path)
    tasks = store.lease(4, "w", 60)
    store.submit([finished(t) for t in tasks])
    served = batch(store, 2)
    assert store.trained(served["batch_id"], 3) == 2 and store.trained(served["batch_id"], 3) == 2  # said again: moot
    with pytest.raises(LeaseConflict, match="trained in step 3 already, not again in step 4"):
        store.trained(served["batch_id"], 4)  # a second step would train its Samples twice
    assert store.trained("never-served", 3) == 0
    rows = store._db.execute("SELECT group_index, state, trained_step FROM groups ORDER BY group_index").fetchall()
    assert rows == [(0, "consumed", 3), (1, "consumed", 3)] and store.stats()["counters"]["groups_trained"] == 2
    store.close()
    store = make(tmp_path)  # the record is durable
    with pytest.raises(LeaseConflict):
        store.trained(served["batch_id"], 5)


def test_each_task_records_the_rollout_that_played_it(tmp_path):
    store = make(tmp_path)
    items = [finished(t) for t in store.lease(4, "w", 60)]
    for position, (_, sample) in enumerate(items):
        if position < 3:  # the last: a rollout function's Sample the job did not name
            sample.metadata["rollout_id"] = 7 + position // 2
    store.submit(items)
    store.close()
    with sqlite3.connect(tmp_path / "buffer.db") as db:
        played = db.execute("SELECT rollout_id FROM samples ORDER BY group_index, sample_index").fetchall()
    assert played == [(7,), (7,), (8,), (None,)]


def test_a_buffer_file_from_before_trained_steps_and_rollout_ids_opens_and_records_them(tmp_path):
    store = make(tmp_path)
    tasks = store.lease(4, "w", 60)
    store.submit([finished(t) for t in tasks[:2]])
    served = batch(store, 1)
    store.close()
    with sqlite3.connect(tmp_path / "buffer.db") as db:  # as the schema was before the columns
        db.execute("ALTER TABLE groups DROP COLUMN trained_step")
        db.execute("ALTER TABLE samples DROP COLUMN rollout_id")
    store = make(tmp_path)
    assert store.trained(served["batch_id"], 0) == 1
    lease, sample = finished(tasks[2])
    sample.metadata["rollout_id"] = 1
    assert store.submit([(lease, sample)]).accepted == 1


def test_num_epoch_stops_leasing(tmp_path):
    store = make(tmp_path, num_epoch=1, n_samples_per_prompt=1)
    assert len(store.lease(100, "w", 60)) == 10
    assert store.lease(5, "w", 60) == []


def test_load_prompts_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"question": "hi", "answer": "1", "meta": {"k": 1}},
        {"question": [{"role": "user", "content": "q"}], "answer": "2", "tools": [{"type": "function"}]},
    ]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pq.write_table(pa.Table.from_pylist([{"question": "hi", "answer": "1"}]), tmp_path / "d.parquet")
    got = load_prompts(
        str(tmp_path / "d.jsonl"), input_key="question", label_key="answer", metadata_key="meta", tool_key="tools"
    )
    assert got[0] == PromptRecord(prompt="hi", label="1", metadata={"k": 1}, tools=None)
    assert got[1].prompt == [{"role": "user", "content": "q"}] and got[1].tools == [{"type": "function"}]
    assert (
        load_prompts(
            str(tmp_path / "d.parquet"), input_key="question", label_key="answer", metadata_key=None, tool_key=None
        )[0].prompt
        == "hi"
    )
    with pytest.raises(ConfigError, match="row 0 has no text"):
        load_prompts(str(tmp_path / "d.jsonl"), input_key="input", label_key=None, metadata_key=None, tool_key=None)


def test_a_group_sampled_outside_the_task_flow_is_recorded_as_served_beside_the_dataset(tmp_path):
    """``record`` (tinker-serve's samples): a prompt after the dataset's, a group consumed at once under
    its batch, its samples indexed in order, read back by the viewer's archive; leasing is untouched."""
    from inverted.buffer.archive import BufferArchive

    store = SQLiteStore(str(tmp_path / "b.db"), n_samples_per_prompt=2, prompts=[PromptRecord("a"), PromptRecord("b")])
    drawn = [
        Sample(
            tokens=[1, 2, 3],
            response_length=1,
            loss_mask=[1],
            rollout_log_probs=[-0.5],
            weight_versions=["3"],
            status=Sample.Status.COMPLETED,
        ),
        Sample(
            tokens=[1, 2, 4, 5],
            response_length=2,
            loss_mask=[1, 1],
            rollout_log_probs=[-1.0, -2.0],
            weight_versions=["3", "4"],
            status=Sample.Status.TRUNCATED,
        ),
    ]
    assert store.record(PromptRecord("", metadata={"prompt_tokens": 2}), drawn, "m:3") == 0
    assert store.record(PromptRecord(""), drawn[:1], "m:4") == 1
    # the dataset's groups come after, from its own prompts
    leased = store.lease(2, "w", 60)
    assert [(t["group_index"], t["prompt_index"], t["prompt"]) for t in leased] == [(2, 0, "a"), (2, 0, "a")]
    store.close()  # and after a restart: the recorded prompt is no dataset prompt
    store = SQLiteStore(str(tmp_path / "b.db"), n_samples_per_prompt=2, prompts=[PromptRecord("a"), PromptRecord("b")])
    assert [t["prompt"] for t in store.lease(6, "w", 60)] == ["b", "b", "a", "a", "b", "b"]
    archive = BufferArchive(tmp_path / "b.db")
    groups = {g.group_index: g for g in archive.groups_from(0)}
    assert (groups[0].state, groups[0].batch_id, groups[0].prompt_index, groups[1].batch_id) == (
        "consumed",
        "m:3",
        2,
        "m:4",
    )
    assert json.loads(archive.prompt(2))["metadata"] == {"prompt_tokens": 2}
    stored = [Sample.from_json(orjson.loads(row[3])) for row in archive.samples_after(0)]
    assert [(s.group_index, s.index, s.tokens, s.rollout_log_probs, s.status) for s in stored] == [
        (0, 0, [1, 2, 3], [-0.5], Sample.Status.COMPLETED),
        (0, 1, [1, 2, 4, 5], [-1.0, -2.0], Sample.Status.TRUNCATED),
        (1, 0, [1, 2, 3], [-0.5], Sample.Status.COMPLETED),
    ]
