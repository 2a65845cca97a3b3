"""A coding task for an unchanged coding-agent harness: mini-swe-agent fixes a tiny repository's failing test.

Each row names one of the repositories below (``metadata.repo``); the rows never carry code. An
episode copies that repository into a fresh temporary directory and runs mini-swe-agent's ``mini``
command there, unchanged, pointed at the session by its documented settings (litellm's
``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``, read off the ``client`` the episode is given), in its
documented unsandboxed mode (``--yolo``, its local environment: no sandbox can start in this
container) with a ``HOME`` inside the temporary directory too: every command the model writes
runs with the copy as its working directory, never the job's. The reward is whether the
repository's test passes in the copy afterwards (1.0) or not (0.0); the copy is then deleted.

mini-swe-agent is installed by ``make harnesses``. A 135M model is not expected to learn this;
the environment is here so that a harness's episodes run through the whole job: ``python -m
envs.coding --out data/coding.jsonl`` writes the rows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

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


def harness() -> str:
    found = Path(sys.executable).parent / "mini"
    if not found.exists():
        raise RuntimeError(f"{found} is missing: mini-swe-agent is installed by `make harnesses`")
    return str(found)


async def run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float | None = None) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(*argv, cwd=cwd, env=env, stdin=asyncio.subprocess.DEVNULL,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
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
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home), "OPENAI_BASE_URL": str(client.base_url),
               "OPENAI_API_KEY": client.api_key, "MSWEA_CONFIGURED": "true", "MSWEA_COST_TRACKING": "ignore_errors",
               "MSWEA_SILENT_STARTUP": "1", "MSWEA_GLOBAL_CONFIG_DIR": str(home / "mini-swe-agent")}
        await run([harness(), "-m", "openai/policy", "-t", task.prompt, "--yolo", "--exit-immediately", "-l", "0",
                   "-o", str(home / "trajectory.json")], work, env)
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
