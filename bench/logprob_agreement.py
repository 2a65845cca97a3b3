"""How closely each rollout server's sampled-token log-probs agree with ``transformers`` at fp32. Prints JSON.

The embedded engine and, with ``--sglang PYTHON`` (``make sglang``: ``.sglang/bin/python``), real SGLang
each sample from the same prompts; ``transformers`` then recomputes every sampled token's log-prob over
the whole sequence twice: in fp32 (the log-softmax in fp64), a third, independent fp32 implementation,
and wholly in fp64, the exact value to about 1e-12. Each fp32 implementation's gap to the fp64 value is
its own rounding error; two of them disagree by up to the sum of theirs. So the gaps show the floor of
fp32 agreement for the model: a trainer/server gap of the same size is arithmetic order, not a bug.

    python bench/logprob_agreement.py --model models/smollm2-135m --sglang .sglang/bin/python
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inverted.processes import ManagedProcess, free_port  # noqa: E402
from inverted.rollout.servers import SGLANG_LAUNCH  # noqa: E402


def start(kind: str, model: str, python: str, threads: int) -> ManagedProcess:
    port = free_port()
    argv = (
        [
            sys.executable,
            "-m",
            "inverted.cli",
            "serve-engine",
            "--model",
            model,
            "--port",
            str(port),
            "--num-threads",
            str(threads),
        ]
        if kind == "embedded"
        else [python, str(SGLANG_LAUNCH), "--model-path", model, "--port", str(port)]
    )
    server = ManagedProcess.spawn(
        kind,
        argv,
        Path(f"runs/bench/agreement-{kind}.log"),
        f"http://127.0.0.1:{port}",
        {"OMP_NUM_THREADS": str(threads)},
    )
    server.wait_healthy(600)
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/smollm2-135m")
    parser.add_argument("--sglang", default="", help="SGLang's interpreter (without it: the embedded engine only)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    fp32 = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    fp64 = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float64).eval()
    prompts = [[1, 2, 3, 400 + i * 37, 900 + i, 17, 42 + i, *range(100 + i, 160 + i)] for i in range(args.prompts)]
    results: dict[str, dict] = {}
    floor: list[float] = []
    for kind in ["embedded"] + (["sglang"] if args.sglang else []):
        server = start(kind, args.model, args.sglang, args.threads)
        gaps: dict[str, list[float]] = {"transformers_fp32": [], "fp64": []}
        try:
            for prompt in prompts:
                out = httpx.post(
                    server.url + "/generate",
                    timeout=600,
                    json={
                        "input_ids": prompt,
                        "return_logprob": True,
                        "sampling_params": {"max_new_tokens": args.new_tokens, "temperature": 1.0, "ignore_eos": True},
                    },
                ).json()
                served = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
                own, exact = (sampled_logprobs(m, prompt, out["output_ids"]) for m in (fp32, fp64))
                gaps["transformers_fp32"] += [abs(a - b) for a, b in zip(served, own)]
                gaps["fp64"] += [abs(a - b) for a, b in zip(served, exact)]
                if kind == "embedded":  # transformers' own fp32 rounding, on the same tokens
                    floor += [abs(a - b) for a, b in zip(own, exact)]
        finally:
            server.terminate()
        results[kind] = {reference: summary(values) for reference, values in gaps.items()}
    results["transformers_fp32"] = {"fp64": summary(floor)}
    print(json.dumps({"bench": "logprob_agreement", "model": args.model, "gap_to": results}, indent=2))


def sampled_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> list[float]:
    """The log-prob of each of ``output``'s tokens after ``prompt`` (the log-softmax in fp64)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].double()
    table = torch.log_softmax(logits, -1)
    return [table[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)]


def summary(gaps: list[float]) -> dict[str, float]:
    return {"tokens": len(gaps), "mean_abs_gap": sum(gaps) / len(gaps), "max_abs_gap": max(gaps)}


if __name__ == "__main__":
    main()
