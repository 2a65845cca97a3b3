"""A job under top-p and top-k: every sampled token's kept set recorded and replayed, so the trainer's
log-probs of the tokens it sampled itself equal the servers' as exactly as under the whole
distribution, while the same tokens' whole-vocabulary log-probs are far off (the bias the masks
remove); without the masks the job says on every step that its ratios are biased. A server that
returns no masks is found before anything trains."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from envs import letters
from envs.datasets import write_dataset
from inverted.rollout.sglang_client import SGLangClient, without_sampling_masks
from tests.job.test_train_job import ROOT, check, inverted, metrics_rows, stored_samples

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("cut", [["--rollout-top-p", "0.9"], ["--rollout-top-k", "20"]], ids=["top_p", "top_k"])
def test_cut_sampling_is_replayed_exactly(tiny_model, tmp_path, cut):
    data = write_dataset(letters.rows, tmp_path / "letters.jsonl", count=64)
    run = tmp_path / "run"
    check(
        inverted(
            "train",
            "--config",
            str(ROOT / "examples/demo.yaml"),
            "--hf-checkpoint",
            str(tiny_model()),
            "--prompt-data",
            str(data),
            "--output-dir",
            str(run),
            "--num-rollout",
            "2",
            *cut,
        )
    )
    rows = [r for r in metrics_rows(run) if "train/loss" in r]
    for row in rows:
        assert row["train/kept_set_tokens"] == 1.0 and row["rollout/kept_set_tokens"] > 0
        assert row["train/fresh_logprob_abs_diff"] <= 1e-6 and row["train/fresh_logprob_abs_diff_max"] <= 3e-5
        assert row["train/rollout_ratio_outside"] == 0.0
        # what a trainer that ignored the sets would see, on the same tokens
        assert row["train/unmasked_logprob_abs_diff"] > 0.05 and row["train/unmasked_ratio_outside"] > 0.5
        assert row["train/kept_set_size_mean"] <= (20 if "--rollout-top-k" in cut else 512)
        assert "rollout/biased_ratios" not in row
    for sample in stored_samples(run).values():
        kept = sample.kept_sets()
        assert all((len(k) > 0) == bool(m) for k, m in zip(kept, sample.loss_mask))
        assert all(token in k for token, k in zip(sample.response_tokens, kept) if k)


def test_without_masks_the_job_says_its_ratios_are_biased(tiny_model, tmp_path):
    data = write_dataset(letters.rows, tmp_path / "letters.jsonl", count=64)
    run = tmp_path / "run"
    result = inverted(
        "train",
        "--config",
        str(ROOT / "examples/demo.yaml"),
        "--hf-checkpoint",
        str(tiny_model()),
        "--prompt-data",
        str(data),
        "--output-dir",
        str(run),
        "--num-rollout",
        "1",
        "--rollout-top-p",
        "0.9",
        "--sampling-mask-top-k",
        "0",
    )
    check(result)
    assert "every importance ratio is biased" in result.stderr
    rows = [r for r in metrics_rows(run) if "train/loss" in r]
    assert rows and all(r["rollout/biased_ratios"] == 1.0 and "train/kept_set_size_mean" not in r for r in rows)
    assert all(s.rollout_top_p_token_ids is None for s in stored_samples(run).values())


class NoMasks(http.server.BaseHTTPRequestHandler):
    """A /generate that answers as an SGLang from before return_sampling_mask: the rest of its answer."""

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"text": "a", "output_ids": [5], "meta_info": {"finish_reason": {"type": "length"}}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.anyio
async def test_a_server_without_masks_is_found_before_anything_trains(procs, tiny_model):
    engine = procs.engine(tiny_model())
    async with SGLangClient(engine.url) as client:
        assert await without_sampling_masks(client) is None
    old = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NoMasks)
    threading.Thread(target=old.serve_forever, daemon=True).start()
    try:
        async with SGLangClient(f"http://127.0.0.1:{old.server_port}") as client:
            assert await without_sampling_masks(client) == "its answer has no meta_info.output_token_sampling_mask"
    finally:
        old.shutdown()
