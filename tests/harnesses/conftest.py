"""The real stack for the harnesses: a tiny checkpoint with a 64k context (their first prompts run to
30,000 tokens) in the embedded engine, the real sgl-router, the proxy; and the harnesses themselves,
installed pinned by ``make harnesses``.

``taught_episode`` runs a harness unchanged, stage by stage: each stage's run shows what the harness
sent at the next turn (captured on the way in by ``tap``), and the model is taught to answer it
(``teach``) before the next run. The last run, with every reply taught, is the episode the tests
check: at least two model calls with a tool call between, recorded exactly.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest
from transformers import AutoTokenizer

from inverted.config import TinyModelConfig
from inverted.tiny_model import make_tiny_model
from inverted.types import Sample
from tests.conftest import ProcessPool, server_requests
from tests.harnesses.tap import tap
from tests.harnesses.teach import teach

ROOT = Path(__file__).resolve().parents[2]
HARNESSES = ROOT / ".harnesses" / "node_modules" / ".bin"
CONTEXT = 65536
ADMIN = {"Authorization": "Bearer admin-key"}


def harness_binary(name: str) -> Path:
    path = HARNESSES / name
    if not path.exists():
        pytest.fail(f"{path} is missing: `make harnesses` installs the coding-agent harnesses (make test does)")
    return path


@pytest.fixture(scope="session")
def long_model(models_dir) -> Path:
    out = models_dir / "qwen2-tiny-64k"
    if not (out / "config.json").exists():
        make_tiny_model(TinyModelConfig(out=str(out), max_positions=CONTEXT))
    return out


@dataclass
class Played:
    """A harness run: its process's result, the requests it sent, the session's Samples and the engine's log."""

    done: Any
    requests: list[dict[str, Any]]
    samples: list[Sample]
    engine_log: list[dict[str, Any]]

    @property
    def episode(self) -> Sample:
        """The episode's Sample, as the rollout takes it: the main model's last branch."""
        return self.main[-1]

    @property
    def calls(self) -> list[tuple[list[int], dict[str, Any]]]:
        """The main model's calls in the order they were made, each as (its prompt ids, its turn). A harness
        may start a new branch for a call: mini-swe-agent drops a reply it cannot use, AutoGen reflects on
        a tool's result without the tools (another system prompt)."""
        seen: dict[tuple, tuple[list[int], dict[str, Any]]] = {}
        for sample in self.main:
            for turn in sample.metadata["turns"]:  # a forked branch repeats the turns it shares
                seen.setdefault((turn["created"], turn["start"]), (sample.tokens[: turn["start"]], turn))
        return [seen[key] for key in sorted(seen)]

    @property
    def main(self) -> list[Sample]:
        main = [s for s in self.samples if not s.metadata.get("side_call")]
        assert main, f"no main branch among {[s.metadata.get('model') for s in self.samples]}"
        return main


@dataclass
class HarnessStack:
    engine: Any
    proxy: Any
    model: Path
    work: Path
    loaded: Path = field(init=False)

    def __post_init__(self) -> None:
        self.loaded = self.model
        self.tokenizer = AutoTokenizer.from_pretrained(self.model)

    def load(self, model: Path) -> None:
        """The engine's weights from ``model`` (SGLang's update_weights_from_disk); its cache is flushed."""
        answer = httpx.post(self.engine.url + "/update_weights_from_disk", json={"model_path": str(model)}, timeout=120)
        assert answer.status_code == 200 and answer.json()["success"], answer.text
        self.loaded = model

    def engine_requests(self) -> list[dict]:
        return server_requests(self.engine)

    def play(self, run: Callable[[str, Path], Any], script: list[str] | None = None) -> Played:
        """One harness run in a fresh session: greedy, each reply at most 128 tokens (the session's
        settings, not the harness's: an untaught model would otherwise write to the end of the context).
        ``script``: the replies the session's calls answer with instead of sampling (the proxy's
        ``script``), for a test of what the harness does with them, not of what was sampled."""
        body: dict[str, Any] = {"sampling_params": {"temperature": 0, "max_tokens": 128}}
        if script is not None:  # a scripted reply is cut at max_tokens too: each must fit whole
            body["script"] = [self.tokenizer.encode(reply, add_special_tokens=False) for reply in script]
            body["sampling_params"]["max_tokens"] = max(128, *map(len, body["script"]))
        session = httpx.post(self.proxy.url + "/sessions", headers=ADMIN, json=body).json()
        before = len(self.engine_requests())
        path = session["base_url"].removeprefix(self.proxy.url)
        with tap(self.proxy.url) as (url, requests):
            done = run(url + path, self.work)
        answer = httpx.post(f"{self.proxy.url}/sessions/{session['session_id']}/finish", headers=ADMIN)
        assert answer.status_code == 200, answer.text
        samples = [Sample.from_json(s) for s in answer.json()["samples"]]
        return Played(done, requests, samples, self.engine_requests()[before:])

    def _after_forced(self, prompt: list[int], reply: str) -> list[int]:
        """The reply's ids after what the proxy already wrote past the generation prompt: a harness that
        sets ``tool_choice: required`` (smolagents) has the call's opening written for it."""
        ids = self.tokenizer.encode(reply, add_special_tokens=False)
        if self.tokenizer.decode(prompt).endswith("<|im_start|>assistant\n"):
            return ids
        overlap = next(n for n in range(min(len(ids), len(prompt)), -1, -1) if prompt[len(prompt) - n :] == ids[:n])
        assert overlap, "the prompt ends past the generation prompt with none of the reply"
        return ids[overlap:]

    def taught_episode(self, run: Callable[[str, Path], Any], replies: list[str], tmp: Path) -> Played:
        """Teach the model ``replies``, one per call of the harness's main model, at the prompts the harness
        really sends (each captured by the run before), then play the whole episode."""
        examples: list[tuple[list[int], list[int]]] = []
        self.load(self.model)
        for k, reply in enumerate(replies):
            played = self.play(run)
            calls = played.calls
            assert len(calls) > k, f"stage {k}: the harness made {len(calls)} calls: {played.done}"
            examples.append((calls[k][0], self._after_forced(calls[k][0], reply)))
            taught = teach(self.model, tmp / f"taught-{k}", examples)
            self.load(taught)
        return self.play(run)


def start_harness_stack(request, long_model: Path, tmp_path_factory, backend: str) -> Iterator[HarnessStack]:
    pool = ProcessPool(tmp_path_factory.mktemp("harness-logs"))
    failures_before = request.session.testsfailed
    # SGLang's KV pool must hold one whole context (the launcher's CPU default holds half of it)
    pool_size = ["--max-total-tokens", str(2 * CONTEXT)] if backend == "sglang" else []
    engine = pool.logged_server(backend, long_model, "--context-length", str(CONTEXT), *pool_size)
    router = pool.routed(engine)
    proxy = pool.proxy(router.url, long_model, "--proxy-api-key", "admin-key", "--context-length", str(CONTEXT))
    yield HarnessStack(engine, proxy, long_model, tmp_path_factory.mktemp("work"))
    pool.close(request.session.testsfailed > failures_before)


@pytest.fixture(scope="session")
def harness_stack(request, long_model, tmp_path_factory) -> Iterator[HarnessStack]:
    """One stack for every harness test (each test loads the weights it teaches, and plays fresh sessions)."""
    yield from start_harness_stack(request, long_model, tmp_path_factory, "embedded")


def fresh_repo(work: Path) -> Path:
    """The harness's working directory: a throw-away copy with one file, made anew for every run."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "notes.txt").write_text("the answer is 42\n")
    return work
