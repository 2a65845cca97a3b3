"""The flags slime's launch scripts pass to ``train.py``, and what ``inverted train`` does with each.

slime's scripts collect ``train.py``'s flags in bash arrays (``MODEL_ARGS=(...)``, ``ROLLOUT_ARGS+=(...)``;
``scripts/models/*.sh`` define the model's) and on the ``train.py`` / ``train_async.py`` command
line itself. This reads every ``.sh`` of a slime checkout (a bare git directory works: its HEAD),
prints each flag's status here (implemented by inverted, accepted without effect, refused and
why, or unrecognized) and, with ``--write``, stores the flag list in
``tests/compat/slime_script_flags.txt``, which the tests check without slime.

    python tools/slime_scripts.py SLIME_CHECKOUT [--write]
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
from pathlib import Path

LIST = Path(__file__).resolve().parent.parent / "tests" / "compat" / "slime_script_flags.txt"
FLAG = re.compile(r"(?:^|[\s\"'(])(--[a-z][a-z0-9-]*)")


def scripts(checkout: Path) -> dict[str, str]:
    if (checkout / "train.py").exists():
        return {str(p.relative_to(checkout)): p.read_text() for p in checkout.rglob("*.sh")}
    names = subprocess.run(
        ["git", "-C", str(checkout), "ls-tree", "-r", "--name-only", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.split()
    return {
        n: subprocess.run(
            ["git", "-C", str(checkout), "show", f"HEAD:{n}"], capture_output=True, text=True, check=True
        ).stdout
        for n in names
        if n.endswith(".sh")
    }


def train_flags(text: str) -> list[str]:
    """The flags in a script's ``*ARGS`` arrays and on its ``train.py`` command line."""
    found: list[str] = []
    inside = command = False
    for line in text.splitlines():
        code = line.split("#", 1)[0] if not line.lstrip().startswith("#") else ""
        if re.match(r"\s*[A-Z_]*ARGS\+?=\(", code):
            inside = True
        if re.search(r"\btrain(_async)?\.py\b", code):
            command = True
            code = code[re.search(r"\btrain(_async)?\.py\b", code).end() :]
        if inside or command:
            found += FLAG.findall(code)
        if inside and code.rstrip().endswith(")"):
            inside = False
        if command and not code.rstrip().endswith("\\"):
            command = False
    return found


def status_here(option: str) -> tuple[str, str]:
    """What ``inverted train`` does with ``option`` given a value other than slime's default."""
    from inverted.cli import build_parser
    from inverted.compat.slime_flags import describe

    train = build_parser()._subparsers._group_actions[0].choices["train"]
    ours = {o for action in train._actions for o in action.option_strings}
    return ("inverted", "inverted's own flag") if option in ours else describe(option)


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("slime", type=Path)
    cli.add_argument("--write", action="store_true")
    options = cli.parse_args()
    texts = scripts(options.slime)
    used = collections.Counter()
    launching = 0
    for name, text in sorted(texts.items()):
        flags = set(train_flags(text))
        launching += bool(flags)
        used.update(flags)
    statuses = collections.defaultdict(list)
    for flag in sorted(used):
        status, why = status_here(flag)
        statuses[status].append((flag, why))
    print(f"{len(used)} distinct flags in {launching} scripts")
    for status, flags in statuses.items():
        print(f"\n{status}: {len(flags)}")
        for flag, why in flags:
            print(f"  {flag}  {why}")
    if options.write:
        commit = subprocess.run(
            ["git", "-C", str(options.slime), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        LIST.write_text(
            f"# the flags slime's launch scripts pass to train.py, at slime {commit} (tools/slime_scripts.py)\n"
            + "".join(f"{flag}\n" for flag in sorted(used))
        )
        print(f"-> {LIST}")


if __name__ == "__main__":
    main()
