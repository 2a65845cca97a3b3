"""Load slime's own plug-ins, verbatim from a slime checkout, through inverted's plug-in loader.

Each entry is a plug-in that slime's launch scripts or docs name (``--*-path``), from slime's
``slime/rollout/`` and ``examples/``, that needs nothing beyond a CPU and PyPI. The checkout's
``slime`` package is not put on the path (inverted's compat layer provides slime's module paths);
an in-tree plug-in module is loaded from its file under its own name, an example from its
directory. Each line says whether inverted's loader takes it for its flag, or why not.

With ``--run``, each is then run unchanged in a real job (``inverted train`` on a tiny random model,
one rollout, two where a plug-in lives across rollouts; ``--debug-rollout-only`` unless the plug-in
is the trainer's), beside slime's rule-based reward model where it needs one, a served teacher model
for on-policy distillation, a rollout dump in slime's format (written by a job here) for
``forge_load``; ``sleep_rollout``, which never returns by design, must reach the rollout, stay
there and stop on Ctrl-C. ``INVERTED_SLIME_SOURCE`` lets slime's in-tree plug-in modules import
from the checkout. Each line then says whether the job ran, or its error.

    python tools/slime_plugins.py SLIME_CHECKOUT [--run [--only PATH_PART]]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slime_flags import _work_tree  # noqa: E402

# (flag, path, in-tree file or example directory)
PLUGINS = [
    (
        "--dynamic-sampling-filter-path",
        "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
        None,
    ),
    (
        "--dynamic-sampling-filter-path",
        "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std_with_fallback",
        None,
    ),
    ("--custom-rm-path", "slime.rollout.rm_hub.async_rm", None),
    ("--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout", None),
    ("--rollout-function-path", "slime.rollout.sleep_rollout.sleep", "slime/rollout/sleep_rollout.py"),
    (
        "--custom-generate-function-path",
        "slime.rollout._fanout_test_helpers.compact_generate",
        "slime/rollout/_fanout_test_helpers.py",
    ),
    (
        "--custom-reward-post-process-path",
        "slime.rollout._fanout_test_helpers.grpo_normalize_by_group_index",
        "slime/rollout/_fanout_test_helpers.py",
    ),
    (
        "--custom-generate-function-path",
        "slime.rollout.sglang_streaming_rollout.generate_streaming",
        "slime/rollout/sglang_streaming_rollout.py",
    ),
    (
        "--rollout-function-path",
        "slime.rollout.fully_async_rollout.generate_rollout_fully_async",
        "slime/rollout/fully_async_rollout.py",
    ),
    ("--rollout-function-path", "slime.rollout.forge_load.generate_rollout", "slime/rollout/forge_load.py"),
    ("--custom-generate-function-path", "generate_with_search.generate", "examples/search-r1"),
    ("--custom-rm-path", "generate_with_search.reward_func", "examples/search-r1"),
    ("--custom-generate-function-path", "generate_with_retool.generate", "examples/retool"),
    ("--custom-rm-path", "generate_with_retool.reward_func", "examples/retool"),
    ("--custom-tis-function-path", "mis.compute_mis_weights_with_cp", "examples/train_infer_mismatch_helper"),
    ("--custom-generate-function-path", "rollout_with_multi_agents.generate_with_multi_agents", "examples/multi_agent"),
    ("--custom-rm-path", "slime.rollout.on_policy_distillation.reward_func", "slime/rollout/on_policy_distillation.py"),
    (
        "--custom-reward-post-process-path",
        "slime.rollout.on_policy_distillation.post_process_rewards",
        "slime/rollout/on_policy_distillation.py",
    ),
]


def load(flag: str, path: str):
    from inverted.buffer.filters import load_group_filter
    from inverted.config import BufferConfig, LossConfig
    from inverted.plugins import LossPlugins, RewardModel, load_hook, load_rollout_function

    if flag == "--rollout-function-path":
        return load_rollout_function(path)
    if flag == "--custom-rm-path":
        return RewardModel.load(path, group=False)
    if flag == "--dynamic-sampling-filter-path":
        return load_group_filter(BufferConfig(dynamic_sampling_filter_path=path))
    if flag == "--custom-generate-function-path":
        return load_hook(path, point="generate", flag=flag)
    if flag == "--custom-tis-function-path":
        return LossPlugins.load(LossConfig(custom_tis_function_path=path))
    if flag == "--custom-reward-post-process-path":
        return LossPlugins.load(LossConfig(custom_reward_post_process_path=path))
    raise ValueError(flag)


ROOT = Path(__file__).resolve().parent.parent
SINGLE_TURN = ["--rollout-function-path", "rollout_functions.single_turn:generate_rollout", "--rm-type", "random"]
# what each needs besides itself to run: slime's default rollout and reward model, its own config;
# {tree}: the checkout, {dump}: a rollout dump in slime's format (written by a job here first),
# {teacher}: a served teacher model's /generate (on-policy distillation)
OPD = ["--use-opd", "--opd-type", "sglang", "--rm-url", "{teacher}"]
RUN_WITH = {
    "slime.rollout.sleep_rollout.sleep": [],  # sleeps forever by design: see SLEEPS
    "slime.rollout.rm_hub.async_rm": SINGLE_TURN,
    "slime.rollout.sft_rollout.generate_rollout": [
        "--loss-mask-type",
        "qwen",
        "--n-samples-per-prompt",
        "1",
        "--loss-type",
        "sft_loss",
    ],
    "mis.compute_mis_weights_with_cp": [
        *SINGLE_TURN,
        "--custom-config-path",
        "{tree}/examples/train_infer_mismatch_helper/mis.yaml",
    ],
    "generate_with_search.reward_func": ["--custom-generate-function-path", "generate_with_search.generate"],
    "rollout_with_multi_agents.generate_with_multi_agents": [
        "--rm-type",
        "deepscaler",
        "--rollout-max-context-len",
        "1024",
    ],  # as its script
    "generate_with_retool.reward_func": ["--custom-generate-function-path", "generate_with_retool.generate"],
    # slime's default generate-and-reward path on a worker thread: it needs a reward model, over two
    # rollouts (the worker outlives the first)
    "slime.rollout.fully_async_rollout.generate_rollout_fully_async": ["--rm-type", "random", "--num-rollout", "2"],
    # over two rollouts: the second replays the same dump (slime's fallback to 0.pt)
    "slime.rollout.forge_load.generate_rollout": ["--load-forge-rollout-data", "{dump}", "--num-rollout", "2"],
    # the pair, as slime's OPD scripts give them; the post-process trains
    "slime.rollout.on_policy_distillation.reward_func": [
        *OPD,
        "--rollout-function-path",
        "rollout_functions.single_turn:generate_rollout",
    ],
    "slime.rollout.on_policy_distillation.post_process_rewards": [
        *OPD,
        *SINGLE_TURN[:2],
        "--custom-rm-path",
        "slime.rollout.on_policy_distillation.reward_func",
    ],
}
# runs until stopped, by design: it must reach the rollout, stay in it, and stop on Ctrl-C
SLEEPS = {"slime.rollout.sleep_rollout.sleep"}
# otherwise, by the plug-in's kind: a generate function runs inside slime's default rollout and
# needs a reward model; a rollout function or a reward model needs nothing; the rest run beside both
BY_FLAG = {
    "--rollout-function-path": [],
    "--custom-rm-path": [],
    "--custom-generate-function-path": ["--rm-type", "random"],
}
TRAINER_SIDE = ("--custom-tis-function-path", "--custom-reward-post-process-path")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def job_argv(flag: str, path: str, extra: list[str], model: str, prompts: str, out: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "inverted.cli",
        "train",
        "--hf-checkpoint",
        model,
        "--prompt-data",
        prompts,
        "--num-rollout",
        "1",
        "--num-engines",
        "1",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--rollout-max-response-len",
        "16",
        "--output-dir",
        out,
        "--log-level",
        "warning",
        *([] if flag in TRAINER_SIDE else ["--debug-rollout-only"]),
        flag,
        path,
        *extra,
    ]


def run_job(
    tree: Path, flag: str, path: str, where: str | None, model: str, prompts: str, places: dict[str, str]
) -> str:
    extra = [e.format(tree=tree, **places) for e in RUN_WITH.get(path, BY_FLAG.get(flag, SINGLE_TURN))]
    if path == "slime.rollout.sft_rollout.generate_rollout":  # conversations to learn, as slime's SFT data
        prompts = str(Path(prompts).with_name("sft.jsonl"))
    if path.startswith("generate_with_search."):  # search-r1's rows: a question, its answers as slime's data has them
        prompts = str(Path(prompts).with_name("search.jsonl"))
    out = tempfile.mkdtemp(prefix="slime-plugin-")
    argv = job_argv(flag, path, extra, model, prompts, out)
    # the checkout's root too: examples import their siblings as examples.NAME.module (its slime
    # package then serves only what inverted does not provide: INVERTED_SLIME_SOURCE)
    paths = [str(ROOT), *(str(tree / w) for _, _, w in PLUGINS if w and not w.endswith(".py")), str(tree)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "INVERTED_SLIME_SOURCE": str(tree)}
    if path in SLEEPS:
        return run_until_stopped(argv, env, out)
    try:
        result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=out)
    except subprocess.TimeoutExpired:
        return "did not finish in 300 s"
    if result.returncode == 0:
        return ""
    lines = [line for line in result.stderr.splitlines() if "error" in line.lower() or "Error" in line]
    return (lines[-1] if lines else result.stderr.strip().splitlines()[-1])[:300]


def run_until_stopped(argv: list[str], env: dict[str, str], out: str, stay: float = 30.0) -> str:
    """A rollout function that never returns: the job reaches the rollout and stays in it, then
    stops on Ctrl-C (SIGINT) without waiting for it."""
    log = Path(out) / "job.log"
    with log.open("w") as sink:
        job = subprocess.Popen(argv, env=env, stdout=sink, stderr=subprocess.STDOUT, cwd=out)
        deadline = time.monotonic() + 180
        while "rollout:" not in log.read_text() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
        time.sleep(stay)
        if job.poll() is not None:
            return f"returned (exit {job.returncode}) instead of sleeping: {log.read_text()[-300:]}"
        if "rollout:" not in log.read_text():
            job.kill()
            return "did not reach the rollout in 180 s"
        job.send_signal(signal.SIGINT)
        try:
            job.wait(60)
        except subprocess.TimeoutExpired:
            job.kill()
            return "slept, but did not stop within 60 s of Ctrl-C"
    return ""


def write_dump(model: str, prompts: str, work: Path) -> str:
    """A rollout dump in slime's format, from a job here (--save-debug-rollout-data DIR/{rollout_id}.pt)."""
    template = str(work / "dump" / "{rollout_id}.pt")
    argv = job_argv("--save-debug-rollout-data", template, SINGLE_TURN, model, prompts, str(work / "dump-run"))
    subprocess.run(argv, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True, capture_output=True, timeout=300)
    return template.format(rollout_id=0)


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("slime", type=Path)
    cli.add_argument("--run", action="store_true")
    cli.add_argument("--only", default="", help="run only the plug-ins whose path contains this")
    options = cli.parse_args()
    tree = _work_tree(options.slime, "slime/utils/arguments.py")
    from inverted import compat

    compat.register()  # as the command line does
    ok = 0
    for flag, path, where in PLUGINS:
        if where and where.endswith(".py"):  # an in-tree module, under its own name
            name = path.rpartition(".")[0]
            if name not in sys.modules or getattr(sys.modules[name], "__inverted__", False):
                spec = importlib.util.spec_from_file_location(name, tree / where)
                module = importlib.util.module_from_spec(spec)
                try:
                    spec.loader.exec_module(module)
                    sys.modules[name] = module
                except Exception as exc:  # noqa: BLE001 - reported
                    print(f"NO   {flag} {path}: importing {where}: {type(exc).__name__}: {exc}")
                    continue
        elif where:
            sys.path.insert(0, str(tree / where))
        try:
            load(flag, path)
            ok += 1
            print(f"ok   {flag} {path}")
        except Exception as exc:  # noqa: BLE001 - reported
            print(f"NO   {flag} {path}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    print(f"{ok} of {len(PLUGINS)} load")
    if not options.run:
        return
    from envs.calculator import rows
    from envs.datasets import write_dataset
    from inverted.config import TinyModelConfig
    from inverted.tiny_model import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="slime-plugins-"))
    make_tiny_model(TinyModelConfig(out=str(work / "model")))
    prompts = str(write_dataset(rows, work / "calc.jsonl", 8))
    (work / "sft.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "input": [
                        {"role": "user", "content": f"What is {i} + {i}?"},
                        {"role": "assistant", "content": str(2 * i)},
                    ]
                }
            )
            + "\n"
            for i in range(8)
        )
    )
    (work / "search.jsonl").write_text(
        "".join(
            json.dumps({"input": f"Who wrote book {i}?", "label": {"ground_truth": {"target": [f"author {i}"]}}}) + "\n"
            for i in range(8)
        )
    )
    model = str(work / "model")
    make_tiny_model(TinyModelConfig(out=str(work / "teacher"), seed=1))
    teacher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "inverted.cli",
            "serve-engine",
            "--model",
            str(work / "teacher"),
            "--port",
            str(port := free_port()),
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    places = {"dump": write_dump(model, prompts, work), "teacher": f"http://127.0.0.1:{port}/generate"}
    ran = 0
    try:
        for flag, path, where in PLUGINS:
            if options.only not in path:
                continue
            error = run_job(tree, flag, path, where, model, prompts, places)
            ran += not error
            print(f"{'ran ' if not error else 'FAIL'} {flag} {path}{': ' + error if error else ''}", flush=True)
    finally:
        teacher.terminate()
    print(f"{ran} of {len(PLUGINS)} run unchanged")


if __name__ == "__main__":
    main()
