"""The three pages in a real browser: headless Chromium (Debian's package) driven by Playwright.

The server is the real app on loopback over a run directory written by the real writers
(``run_dir``); what each page shows is checked against what was written: token counts and mask
spans, the reward, the table after a filter, the curves' points, and the colours of tokens in
screenshots, pixel by pixel, against the part or log-prob the data gives each token.
"""

from __future__ import annotations

import io
import shutil
import threading
import time
from collections import Counter

import pytest

from inverted.processes import free_port
from inverted.view.config import ViewConfig
from inverted.view.service import create_app, open_run
from tests.view.run_dir import UNRECORDED, write_run

playwright = pytest.importorskip(
    "playwright.sync_api", reason="playwright is a test dependency (pip install -e '.[test]')"
)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="no Chromium: apt-get install chromium (.ci/run installs it)"),
]
# What the machine's closed network needs (no background connections), and root needs (no sandbox).
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
]
# view.css's token colours (view.js: COLOURS)
PARTS = {"prompt": (232, 232, 232), "sampled": (186, 218, 255), "masked": (255, 214, 153)}


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model):
    run = tmp_path_factory.mktemp("view") / "run"
    written = write_run(run, tiny_model("qwen2"))
    index, _ = open_run(ViewConfig(run_dir=str(run)))
    import uvicorn

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(index, title="a run"), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", written, index
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.problems = problems
    yield page
    page.close()
    assert not problems, problems  # each page loads and works with no console error


def open_page(page, url: str) -> None:
    page.goto(url)
    page.wait_for_selector("body[data-ready]")
    assert page.inner_text("#error") == ""


def colours(png: bytes) -> Counter:
    """How many pixels of each colour a screenshot holds."""
    import numpy as np
    from PIL import Image

    return Counter(map(tuple, np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).reshape(-1, 3).tolist()))


def dominant(png: bytes) -> tuple[int, int, int]:
    return colours(png).most_common(1)[0][0]


def test_the_run_page_draws_the_metrics_it_was_given(served, page):
    url, written, _ = served
    open_page(page, url + "/")
    page.wait_for_function("document.getElementById('reward').data !== undefined")
    traces = page.evaluate(
        "Object.fromEntries(['reward', 'phases', 'throughput', 'mismatch', 'versions'].map("
        "id => [id, document.getElementById(id).data.map(t => [t.name, t.x, t.y])]))"
    )
    reward = {name: (x, y) for name, x, y in traces["reward"]}
    assert reward["rollout reward"] == (
        [m["step"] for m in written.metrics],
        [m["rollout/reward_mean"] for m in written.metrics],
    )
    sampled = {name: y for name, _, y in traces["throughput"]}["sampled (rollout)"]
    assert sampled == pytest.approx([m["rollout/response_tokens"] / m["time/rollout_s"] for m in written.metrics])
    assert {name for name, _, _ in traces["phases"]} == {"rollout", "train", "sync", "step"}
    assert f"{len(written.samples)} samples" in page.inner_text("#counts")
    # the drawn line is there: the first trace's colour (Plotly's #1f77b4) in the chart's screenshot
    assert colours(page.locator("#reward").screenshot())[(31, 119, 180)] > 50


def test_the_trajectory_page_shows_the_sample_token_by_token(served, page):
    url, written, _ = served
    sample = next(s for s in written.samples if (s.group_index, s.index, s.metadata.get("branch")) == (1, 1, 0))
    open_page(page, url + "/trajectory?group=1&index=1&branch=0")
    assert page.locator("#tokens .tok").count() == len(sample.tokens)
    assert page.locator("#tokens .tok.prompt").count() == sample.prompt_length
    assert page.locator("#tokens .tok.masked").count() == sample.loss_mask.count(0) > 0
    assert page.locator("#tokens .tok.sampled").count() == sample.loss_mask.count(1)
    assert page.locator("#tokens .tok.turn-start").count() == 2
    facts = page.inner_text("#facts")
    assert "reward\t1" in facts and f"prompt {sample.prompt_length}" in facts
    assert page.locator("#turns tr").count() == 3  # a header and two turns
    assert "tool_calls" in page.inner_text("#turns") and "<tool_response>42</tool_response>" in page.inner_text(
        "#turns"
    )
    assert "gpt-5.2" in page.inner_text("#turns")  # the model the call asked for, and what it took without effect
    assert "reasoning_effort: the chat template has no thinking mode" in page.inner_text("#turns")
    branches = page.inner_text("#branches")
    assert "branch 1" in branches and "no tool needed" in branches
    assert page.locator("#group tr").count() == 1 + sum(1 for s in written.samples if s.group_index == 1)
    # hover: the token's numbers
    j = sample.loss_mask.index(1)
    page.locator(f"#tokens .tok[data-i='{sample.prompt_length + j}']").hover()
    tip = page.inner_text("#tooltip")
    assert f"rollout log-prob {sample.rollout_log_probs[j]:.4f}" in tip and "trainer log-prob" in tip


def test_a_sample_without_rollout_logprobs_says_so(served, page):
    """A Sample whose sampler recorded no log-probs: nothing to colour or compare, and the page says why."""
    url, written, _ = served
    sample = next(s for s in written.samples if (s.group_index, s.index) == UNRECORDED)
    assert sample.rollout_log_probs is None
    open_page(page, url + f"/trajectory?group={sample.group_index}&index={sample.index}&branch=0")
    assert page.locator("#tokens .tok").count() == len(sample.tokens)
    page.locator(f"#tokens .tok[data-i='{sample.prompt_length}']").hover()
    assert "rollout log-prob not recorded" in page.inner_text("#tooltip")
    for mode in ("logprob", "mismatch"):
        page.select_option("#mode", mode)
        assert page.inner_text("#legend") == "the sampler recorded no log-probs for this Sample"
        assert page.locator("#tokens .tok[style]").count() == 0  # no token coloured


def test_screenshots_show_the_colours_the_data_gives_each_token(served, page):
    url, written, _ = served
    sample = next(s for s in written.samples if (s.group_index, s.index, s.metadata.get("branch")) == (1, 1, 0))
    open_page(page, url + "/trajectory?group=1&index=1&branch=0")
    p = sample.prompt_length
    for i in (0, p, p + sample.loss_mask.index(0), p + len(sample.loss_mask) - 1):
        part = "prompt" if i < p else ("sampled" if sample.loss_mask[i - p] else "masked")
        assert dominant(page.locator(f"#tokens .tok[data-i='{i}']").screenshot()) == PARTS[part], (i, part)
    # by rollout log-prob: white at 0, redder down to -5 (trajectory.html: heat)
    plain = next(s for s in written.samples if s.response_length >= 3 and not s.metadata)
    open_page(page, url + f"/trajectory?group={plain.group_index}&index={plain.index}&branch=0")
    page.select_option("#mode", "logprob")
    for j, logprob in enumerate(plain.rollout_log_probs):
        t = max(0.0, min(1.0, -logprob / 5))
        expected = (255, round(255 - 190 * t), round(255 - 190 * t))
        got = dominant(page.locator(f"#tokens .tok[data-i='{plain.prompt_length + j}']").screenshot())
        assert max(abs(a - b) for a, b in zip(got, expected)) <= 1, (j, logprob, got, expected)


def test_filters_and_presets_change_the_table(served, page):
    url, written, _ = served
    open_page(page, url + "/samples")
    assert int(page.get_attribute("body", "data-total")) == len(written.samples)
    page.fill("input[name=reward_min]", "0.25")
    page.check("input[name=status][value=completed]")
    page.click("#filters button[type=submit]")
    expected = [s for s in written.samples if s.reward >= 0.25 and s.status.value == "completed"]
    page.wait_for_function(f"document.body.dataset.total === '{len(expected)}' && !document.body.dataset.loading")
    rewards = [float(x) for x in page.locator("#samples td.reward").all_inner_texts()]
    assert rewards and all(r >= 0.25 for r in rewards)
    assert set(page.locator("#samples td.status").all_inner_texts()) == {"completed"}
    assert "reward_min=0.25" in page.url  # the view is an address: reload or share it
    page.click("button[data-preset=longest]")
    page.wait_for_function(
        f"document.body.dataset.total === '{len(written.samples)}' && !document.body.dataset.loading"
    )
    lengths = [int(x) for x in page.locator("#samples td.response_length").all_inner_texts()]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] == max(s.response_length for s in written.samples)
    page.click("button[data-preset=zero]")
    page.wait_for_function("!document.body.dataset.loading && location.search.includes('zero_variance')")
    groups = {int(x) for x in page.locator("#samples td.group_index").all_inner_texts()}
    assert groups and all(len({s.reward for s in written.samples if s.group_index == g}) == 1 for g in groups)
    page.click("#samples th[data-key=reward]")  # a header click sorts by it
    page.wait_for_function("!document.body.dataset.loading && location.search.includes('sort=reward')")
    with page.expect_navigation():
        page.locator("#samples td.link a").first.click()
    page.wait_for_selector("body[data-ready]")
    assert page.locator("#tokens .tok").count() > 0


def test_the_run_page_follows_a_running_job(served, page):
    """A row the job appends to metrics.jsonl appears on an open run page without a reload."""
    import json

    url, written, index = served
    open_page(page, url + "/")
    shown = int(page.get_attribute("body", "data-rows"))
    row = {"step": len(written.metrics), "rollout/reward_mean": 0.75}
    with open(index.run_dir / "metrics.jsonl", "a") as file:
        file.write(json.dumps(row) + "\n")
    written.metrics.append(row)
    page.wait_for_function(f"Number(document.body.dataset.rows) === {shown + 1}", timeout=15_000)
    x, y = page.evaluate(
        "(() => { const t = document.getElementById('reward').data"
        ".find(t => t.name === 'rollout reward'); return [t.x, t.y]; })()"
    )
    assert x[-1] == row["step"] and y[-1] == 0.75
