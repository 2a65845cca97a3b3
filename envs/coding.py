"""A coding task for an unchanged coding-agent harness: mini-swe-agent fixes a tiny repository's failing test.

Each row names one of the repositories below (``metadata.repo``); the rows never carry code. An
episode copies that repository into a fresh temporary directory and runs mini-swe-agent's ``mini``
command there, unchanged, pointed at the session by its documented settings (litellm's
``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``, read off the ``client`` the episode is given), with
``--yolo`` (no one approves each command) and its own sandbox mode, its ``bubblewrap`` environment,
given ``envs.sandbox``'s wrapper: each command the model writes runs with no network, the system
read-only but the copy, and limits on its time, memory and processes. Where no sandbox can start
an episode fails with the reason, unless ``INVERTED_SANDBOX=off`` says to run the commands in
mini-swe-agent's local environment (said on stderr once). The reward is whether the repository's
test passes in the copy afterwards (1.0) or not (0.0), run outside the sandbox; the copy is then
deleted.

mini-swe-agent is installed by ``make harnesses``. A 135M model is not expected to learn this;
the environment is here so that a harness's episodes run through the whole job: ``python -m
envs.coding --out data/coding.jsonl`` writes the rows.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
import tempfile
from pathlib import Path

from envs import sandbox

REPOS: dict[str, dict[str, str]] = {
    "off_by_one": {
        "calc.py": "def total(numbers):\n    return sum(numbers[1:])\n",
        "test_calc.py": "from calc import total\n\nassert total([1, 2, 3]) == 6, total([1, 2, 3])\nprint('ok')\n",
    },
    "wrong_operator": {
        "calc.py": "def area(width, height):\n    return width + height\n",
        "test_calc.py": "from calc import area\n\nassert area(3, 4) == 12, area(3, 4)\nprint('ok')\n",
    },
    "missing_case": {
        "calc.py": "def sign(x):\n    return 1 if x > 0 else -1\n",
        "test_calc.py": "from calc import sign\n\nassert [sign(-2), sign(0), sign(5)] == [-1, 0, 1]\nprint('ok')\n",
    },
}
TEST = "test_calc.py"
PROMPT = "The test in test_calc.py fails. Fix calc.py so that `python test_calc.py` passes."
TEST_TIMEOUT_S = 30
COMMAND_TIMEOUT_S = 30  # each command the model writes


@functools.cache
def sandboxed() -> bool:
    """Whether the model's commands run in the sandbox: always, unless none can start here and
    ``INVERTED_SANDBOX=off`` allows running them unsandboxed."""
    why = sandbox.problem()
    if why is None:
        return True
    if os.environ.get("INVERTED_SANDBOX") != "off":
        raise RuntimeError(
            f"envs.coding runs the model's commands in a sandbox, and {why}; INVERTED_SANDBOX=off runs them unsandboxed"
        )
    print(f"envs.coding: the model's commands run UNSANDBOXED (INVERTED_SANDBOX=off): {why}", file=sys.stderr)
    return False


def harness() -> str:
    found = Path(sys.executable).parent / "mini"
    if not found.exists():
        raise RuntimeError(f"{found} is missing: mini-swe-agent is installed by `make harnesses`")
    return str(found)


async def run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float | None = None) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        async with asyncio.timeout(timeout):
            output, _ = await process.communicate()
    finally:
        if process.returncode is None:  # cancelled (the episode timeout) or timed out: nothing left running
            process.kill()
            await process.wait()
    return process.returncode, output.decode(errors="replace")


async def episode(task, client) -> float:
    repo = REPOS[task.metadata["repo"]]
    with tempfile.TemporaryDirectory(prefix="inverted-coding-") as scratch:
        work, home = Path(scratch) / "repo", Path(scratch) / "home"
        work.mkdir()
        home.mkdir()
        for name, text in repo.items():
            (work / name).write_text(text)
        config = home / "environment.yaml"  # written as JSON, which YAML reads
        if sandboxed():
            sandbox.let_nobody_write(work)
            config.write_text(json.dumps({"environment": sandbox.mini_environment(work, COMMAND_TIMEOUT_S)}))
        else:
            config.write_text(
                json.dumps(
                    {"environment": {"environment_class": "local", "cwd": str(work), "timeout": COMMAND_TIMEOUT_S}}
                )
            )
        env = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": str(home),
            "OPENAI_BASE_URL": str(client.base_url),
            "OPENAI_API_KEY": client.api_key,
            "MSWEA_CONFIGURED": "true",
            "MSWEA_COST_TRACKING": "ignore_errors",
            "MSWEA_SILENT_STARTUP": "1",
            "MSWEA_GLOBAL_CONFIG_DIR": str(home / "mini-swe-agent"),
        }
        await run(
            [
                harness(),
                "-m",
                "openai/policy",
                "-t",
                task.prompt,
                "--yolo",
                "--exit-immediately",
                "-l",
                "0",
                "-c",
                "mini.yaml",
                "-c",
                str(config),
                "-o",
                str(home / "trajectory.json"),
            ],
            work,
            env,
        )
        status, _ = await run([sys.executable, TEST], work, {"PATH": env["PATH"], "HOME": str(home)}, TEST_TIMEOUT_S)
        return 1.0 if status == 0 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--count", type=int, default=len(REPOS), help="rows, cycling over the repositories")
    args = parser.parse_args()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    names = sorted(REPOS)
    with open(args.out, "w") as out:
        for i in range(args.count):
            out.write(json.dumps({"input": PROMPT, "label": TEST, "metadata": {"repo": names[i % len(names)]}}) + "\n")


if __name__ == "__main__":
    main()
