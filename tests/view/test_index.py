"""The viewer's index and its HTTP app, against a run directory written by the real writers.

Every answer is recomputed here from what was written (``run_dir.Written``), not read back from
the index: filters, sorts, steps, fork points, token texts, the trainer's arrays.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time

import httpx
import numpy as np
import orjson
import pytest
from fastapi.testclient import TestClient

from inverted.buffer.store import SQLiteStore
from inverted.hf_checkpoint import load_tokenizer
from inverted.processes import free_port
from inverted.view.config import ViewConfig
from inverted.view.index import SampleQuery
from inverted.view.service import create_app, open_run
from tests.view.run_dir import N, episode, write_run


@pytest.fixture
def run(tmp_path, tiny_model):
    checkpoint = tiny_model("qwen2")
    written = write_run(tmp_path / "run", checkpoint)
    index, _ = open_run(ViewConfig(run_dir=str(tmp_path / "run")))
    index.refresh()
    yield tmp_path / "run", written, index
    index.close()


def key(sample):
    return sample.group_index, sample.index, int(sample.metadata.get("branch", 0))


def expected_rows(written, keep, sort, descending=False):
    rows = []
    for s in written.samples:
        step = written.steps.get(key(s))
        row = {
            "group_index": s.group_index,
            "sample_index": s.index,
            "branch": key(s)[2],
            "step": step,
            "reward": s.reward,
            "response_length": s.response_length,
            "status": s.status.value,
            "mismatch": written.details[key(s)].mismatch if key(s) in written.details else None,
        }
        if keep(row):
            rows.append(row)
    # SQLite's order: unknown values first ascending, and so last descending; ties by the key, in the same direction
    rows.sort(
        key=lambda r: (r[sort] is not None, r[sort] or 0, r["group_index"], r["sample_index"], r["branch"]),
        reverse=descending,
    )
    return rows


@pytest.mark.parametrize(
    "query, keep",
    [
        (SampleQuery(sort="reward"), lambda r: True),
        (SampleQuery(sort="response_length", descending=True), lambda r: True),
        (SampleQuery(reward_min=0.25, reward_max=0.9, sort="group_index"), lambda r: 0.25 <= r["reward"] <= 0.9),
        (
            SampleQuery(status=["truncated"], length_min=5, sort="response_length"),
            lambda r: r["status"] == "truncated" and r["response_length"] >= 5,
        ),
        (SampleQuery(step_min=1, step_max=1, sort="mismatch", descending=True), lambda r: r["step"] == 1),
        (SampleQuery(mismatch_min=0.1, sort="mismatch"), lambda r: r["mismatch"] is not None and r["mismatch"] >= 0.1),
        (SampleQuery(group=1, sort="branch"), lambda r: r["group_index"] == 1),
    ],
)
def test_a_filtered_sorted_page_is_what_the_samples_say(run, query, keep):
    _, written, index = run
    expected = expected_rows(written, keep, query.sort, query.descending)
    query.page_size = 500
    got = index.page(query)
    assert got["total"] == len(expected) > 0
    fields = ("group_index", "sample_index", "branch", "step", "reward", "response_length", "status")
    assert [tuple(r[f] for f in fields) for r in got["rows"]] == [tuple(r[f] for f in fields) for r in expected]
    for row in got["rows"]:
        if row["mismatch"] is not None:
            assert row["mismatch"] == pytest.approx(
                written.details[(row["group_index"], row["sample_index"], row["branch"])].mismatch
            )


def test_zero_variance_groups_and_paging(run):
    _, written, index = run
    rewards: dict[int, set] = {}
    for s in written.samples:
        rewards.setdefault(s.group_index, set()).add(s.reward)
    flat = {g for g, r in rewards.items() if len(r) == 1}
    got = index.page(SampleQuery(zero_variance=True, page_size=500))
    assert {r["group_index"] for r in got["rows"]} == flat and flat
    pages = [index.page(SampleQuery(page=p, page_size=7))["rows"] for p in range(8)]
    assert sum(map(len, pages)) == len(written.samples)
    assert len({(r["group_index"], r["sample_index"], r["branch"]) for page in pages for r in page}) == len(
        written.samples
    )


def test_steps_staleness_and_fate_come_from_the_buffer_and_the_trainer(run):
    _, written, index = run
    rows = index.page(SampleQuery(page_size=500))["rows"]
    for row in rows:
        k = (row["group_index"], row["sample_index"], row["branch"])
        assert row["step"] == written.steps.get(k)
        assert row["group_state"] == ("consumed" if k in written.steps else "complete")
        assert row["staleness"] == written.steps.get(k)  # tokens of version 0, served at version = step
        assert row["advantage"] == (pytest.approx(written.details[k].advantage) if k in written.details else None)


def test_the_index_takes_in_what_a_running_job_writes_later(run, tiny_model):
    path, written, index = run
    before = index.page(SampleQuery())["total"]
    store = SQLiteStore(str(path / "buffer.db"), n_samples_per_prompt=N)  # the job, still running
    tasks = store.lease(N, "worker", 600)
    tokenizer = load_tokenizer(tiny_model("qwen2"))
    import random

    store.submit([(t["lease_id"], episode(t, random.Random(1), 3, tokenizer)) for t in tasks])
    store.next_batch(2, 3, None)  # serves groups 4 and 5: a third batch
    store.close()
    with open(path / "metrics.jsonl", "a") as file:
        file.write('{"step": 2, "rollout/reward_mean": 0.9}\n{"step": 3, "rollout/rew')  # the last line is half-written
    index.refresh()
    assert index.page(SampleQuery())["total"] == before + N
    served = index.page(SampleQuery(step_min=2, page_size=500))["rows"]
    assert {r["group_index"] for r in served} == {4, 5} and all(r["step"] == 2 for r in served)
    assert [m["step"] for m in index.metrics(len(written.metrics))] == [2]  # the half line waits


def test_a_trajectory_token_by_token_with_its_branches_and_group(run, tiny_model):
    _, written, index = run
    tokenizer = load_tokenizer(tiny_model("qwen2"))
    main, fork = [s for s in written.samples if (s.group_index, s.index) == (1, 1)]
    got = index.trajectory(1, 1, 0)
    assert got["tokens"] == main.tokens and got["loss_mask"] == main.loss_mask
    assert got["prompt_length"] == main.prompt_length
    assert "".join(got["text"]) == tokenizer.decode(main.tokens)
    assert len(got["turns"]) == 2 and got["metadata"]["grader"] == {"parsed": "42", "right": True}
    assert "siblings" not in got["metadata"]
    forked_at = next(i for i, (a, b) in enumerate(zip(main.tokens, fork.tokens)) if a != b)
    branches = {b["branch"]: b for b in got["branches"]}
    assert branches[1]["fork_at"] == forked_at and branches[0]["fork_at"] == len(main.tokens)
    assert branches[1]["after_fork"] == tokenizer.decode(fork.tokens[forked_at:])
    detail = written.details[(1, 1, 0)]
    np.testing.assert_array_equal(np.asarray(got["train_log_probs"], dtype=np.float32), detail.log_probs)
    np.testing.assert_array_equal(np.asarray(got["advantages"], dtype=np.float32), detail.advantages)
    assert sorted((r["sample_index"], r["branch"]) for r in got["group"]) == sorted(
        key(s)[1:] for s in written.samples if s.group_index == 1
    )
    other = index.trajectory(1, 1, 1)
    assert other["tokens"] == fork.tokens and other["reward"] == 0.0
    assert index.trajectory(1, 1, 7) is None and index.trajectory(99, 0, 0) is None


def test_the_viewer_cannot_write_the_run(run):
    path, _, index = run
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        index.archive._db.execute("DELETE FROM samples")


def test_routes_bad_input_and_the_key(run):
    _, _, index = run
    with TestClient(create_app(index, api_key="s3cret")) as client:
        assert client.get("/health").json() == {"status": "ok"}
        assert client.get("/api/samples").status_code == 401
        assert client.get("/").status_code == 401
        assert client.get("/api/samples", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        opened = client.get("/samples?key=s3cret&sort=reward", follow_redirects=False)
        assert opened.status_code == 303 and opened.headers["location"] == "/samples?sort=reward"
        assert (
            "httponly" in opened.headers["set-cookie"].lower()
            and "samesite=strict" in opened.headers["set-cookie"].lower()
        )
        assert client.get("/api/run").status_code == 200  # the cookie now
        client.cookies.clear()
        assert client.get("/samples?key=wrong").status_code == 401
        auth = {"Authorization": "Bearer s3cret"}
        for bad in ("sort=tokens", "page_size=100000", "status=lost", "reward_min=abc", "colour=red"):
            assert client.get(f"/api/samples?{bad}", headers=auth).status_code == 422, bad
        assert client.get("/api/trajectory?group=99&index=0", headers=auth).status_code == 404
        assert client.get("/static/..%2Fservice.py", headers=auth).status_code == 404
        assert client.get("/static/view.js", headers=auth).status_code == 200
        assert client.get("/static/plotly.min.js", headers=auth).text.startswith("/**")
        assert client.get("/openapi.json", headers=auth).status_code == 404


def test_inverted_view_serves_a_run_on_loopback_behind_the_runs_own_key(run):
    """A job's run directory holds the job's key (owner-only, ``services/``): the viewer derives its own
    from it, prints the address with it to its owner's console, and refuses everyone else."""
    path, written, _ = run
    (path / "services").mkdir()
    (path / "services" / "buffer.yaml").write_text("api_key: the-jobs-buffer-key\n")
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "inverted.cli", "view", str(path), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        printed = process.stdout.readline()
        url = f"http://127.0.0.1:{port}"
        assert f"{path} at {url}/?key=" in printed
        key = printed.rsplit("?key=", 1)[1].strip()
        assert len(key) == 32 and key not in "the-jobs-buffer-key"  # not the buffer's own key
        for _ in range(300):
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        assert httpx.get(f"{url}/api/run").status_code == 401
        assert httpx.get(f"{url}/api/run", headers={"Authorization": "Bearer the-jobs-buffer-key"}).status_code == 401
        with httpx.Client(base_url=url, follow_redirects=True) as browser:
            assert "inverted view" in browser.get(f"/?key={key}").text
            assert browser.get("/api/run").json()["samples"] == len(written.samples)
    finally:
        process.terminate()
        process.wait(10)


def test_routed_experts_are_shown_per_token_when_the_model_has_them(run):
    """A Mixture-of-Experts run's Samples carry SGLang's routed experts (``[tokens - 1, layers, top_k]``,
    base64 of int32): the trajectory gives each token its experts per layer."""
    from inverted.types import encode_routed_experts

    path, written, index = run
    sample = next(s for s in written.samples if not s.metadata)
    routes = np.arange((len(sample.tokens) - 1) * 2 * 3).reshape(len(sample.tokens) - 1, 2, 3)
    store = SQLiteStore(str(path / "buffer.db"), n_samples_per_prompt=N)
    with store._tx() as db:  # as the proxy would have recorded it (a test of the reader, not the writer)
        data = dict(sample.to_json(), rollout_routed_experts=encode_routed_experts(routes))
        db.execute(
            "UPDATE samples SET sample = ? WHERE group_index = ? AND sample_index = ?",
            (orjson.dumps(data), sample.group_index, sample.index),
        )
    store.close()
    index.experts_shape = (2, 3)
    got = index.trajectory(sample.group_index, sample.index, 0)
    assert got["routed_experts"] == routes.tolist()


def test_each_tokens_kept_set_size_is_shown_when_recorded(run):
    """A Sample sampled under top-p carries each token's kept set (``rollout_top_p_token_ids``/``offsets``):
    the trajectory gives each response token its set's size (0 where none was recorded)."""
    path, written, index = run
    sample = next(s for s in written.samples if not s.metadata)
    sizes = [(i * 7) % 5 for i in range(sample.response_length)]
    offsets = [0, *np.cumsum(sizes).tolist()]
    assert index.trajectory(sample.group_index, sample.index, 0)["kept_set_sizes"] is None
    store = SQLiteStore(str(path / "buffer.db"), n_samples_per_prompt=N)
    with store._tx() as db:  # as the proxy would have recorded it (a test of the reader, not the writer)
        data = dict(
            sample.to_json(), rollout_top_p_token_ids=list(range(offsets[-1])), rollout_top_p_token_offsets=offsets
        )
        db.execute(
            "UPDATE samples SET sample = ? WHERE group_index = ? AND sample_index = ?",
            (orjson.dumps(data), sample.group_index, sample.index),
        )
    store.close()
    assert index.trajectory(sample.group_index, sample.index, 0)["kept_set_sizes"] == sizes
