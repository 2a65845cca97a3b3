"""``python launch.py [--secrets-fd FD] ARGS...``: real SGLang's ``sglang.launch_server`` with ARGS,
set up for the machine it lands on.

``rollout.servers`` starts every real SGLang server through this file, with the interpreter of
SGLang's environment (``--rollout-sglang-python``), which need not hold ``inverted``: so it imports only
the standard library, and is run by its path.

On a machine with a GPU it changes nothing. On one without, it runs SGLang's native PyTorch path
(``docs/user-guide.md``, "Real SGLang on a CPU"; what it cannot do: ``docs/sglang-differences.md``) and
says so in the server's log:

- ``SGLANG_USE_CPU_ENGINE=1``: without it SGLang takes its GPU path and hangs importing vLLM's ops;
- this folder on ``PYTHONPATH``: its ``sitecustomize`` adds the import stand-ins for ``sgl_kernel``
  and ``torchvision`` where they are absent, in the server and in every process it spawns;
- flags the user did not give: ``--device cpu``, ``--dtype float32`` (``auto`` serves a float32
  checkpoint as float16, and the job's log-probs must match the trainer's), a bounded KV pool
  (``--max-total-tokens``; SGLang's default takes 72% of the machine's memory), and
  ``--sleep-on-idle`` (an idle scheduler otherwise spins at 90% of a core).

Keys arrive through a pipe (``--secrets-fd``, written by ``processes.ManagedProcess.spawn``), never
on a command line. SGLang runs in a forked child, so that once it has exited this process removes
what SGLang leaves behind: its IPC files (under a private ``TMPDIR``), its
``/dev/shm/sglang_loads_*`` file and its processes' semaphores.
"""

import importlib.util
import json
import os
import runpy
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")  # as inverted/devices.py
CPU_DEFAULTS = {"--device": "cpu", "--dtype": "float32", "--max-total-tokens": "32768"}
CPU_SWITCHES = ("--sleep-on-idle",)


def cpu_argv(args: list[str]) -> list[str]:
    """``args`` plus each CPU default the user did not set."""
    given = {arg.split("=", 1)[0] for arg in args if arg.startswith("--")}
    extra = [item for flag, value in CPU_DEFAULTS.items() if flag not in given for item in (flag, value)]
    return args + extra + [flag for flag in CPU_SWITCHES if flag not in given]


def read_secrets(args: list[str]) -> list[str]:
    """``args`` without ``--secrets-fd FD``, plus the arguments written to that pipe."""
    if args[:1] != ["--secrets-fd"]:
        return args
    with os.fdopen(int(args[1])) as pipe:
        return args[2:] + json.load(pipe)


def run_sglang(args: list[str]) -> None:
    """In the child: become ``python -m sglang.launch_server ARGS``, killed with the launcher."""
    if sys.platform == "linux":
        import ctypes

        # PR_SET_PDEATHSIG: SGLang's own processes die with it (kill_itself_when_parent_died)
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    sys.argv = ["sglang.launch_server", *args]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


def mapped_files() -> set[str]:
    """Every file some process on this machine has mapped (``/proc/*/maps``)."""
    found: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            found.update(
                line.split(maxsplit=5)[5].strip()
                for line in maps.read_text().splitlines()
                if line.count(" ") >= 5 and "/dev/shm/" in line
            )
        except (OSError, IndexError):
            continue
    return found


def remove_leftovers(scratch: Path, started: float) -> None:
    """SGLang's IPC files (in ``scratch``), and the files in ``/dev/shm`` it made (its load snapshot,
    named after a random instance id; its processes' semaphores) that no process maps any longer."""
    shutil.rmtree(scratch, ignore_errors=True)
    mapped = mapped_files()
    for shm in [*Path("/dev/shm").glob("sglang_loads_*.shm"), *Path("/dev/shm").glob("sem.mp-*")]:
        try:
            if shm.stat().st_mtime >= started and str(shm) not in mapped:
                shm.unlink()
        except FileNotFoundError:
            continue


def wait_for_group(group: int, timeout: float = 10.0) -> None:
    """Until no process of SGLang's group is alive: a process killed with its group still maps its files
    while it exits, and ``remove_leftovers`` keeps a file some process maps (zombies map nothing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = False
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
            except (OSError, ValueError):
                continue
            if int(pgrp) == group and state != "Z":
                alive = True
                break
        if not alive:
            return
        time.sleep(0.05)


def stop(child: int) -> None:
    """Stop SGLang's whole process group at once. Its own SIGTERM path drains, then reads a scheduler
    stopped by it as a crash and sleeps 5 s for crash diagnostics: longer than a job's grace period,
    after which nothing would be left to clean up after it."""
    try:
        os.killpg(child, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: list[str]) -> int:
    args = read_secrets(argv)
    started = time.time()
    scratch = Path(tempfile.mkdtemp(prefix="inverted-sglang-"))
    # SGLang names its IPC sockets with tempfile, in this process (its children get the names): tempfile
    # cached /tmp when it made the scratch folder, so TMPDIR alone would reach only the children
    os.environ["TMPDIR"] = tempfile.tempdir = str(scratch)
    print(f"[inverted] scratch {scratch} (removed at exit)", file=sys.stderr, flush=True)  # whose folder is whose
    if not any(os.path.exists(node) for node in GPU_DEVICE_NODES):
        here = str(Path(__file__).resolve().parent)
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
        args = cpu_argv(args)
        shown = [a for a in args if not a.startswith(("--api-key", "--admin-api-key"))]
        print(
            f"[inverted] no GPU here: SGLang's native PyTorch path, SGLANG_USE_CPU_ENGINE=1, "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, flags {' '.join(shown)}",
            file=sys.stderr,
            flush=True,
        )
        # this process started before PYTHONPATH named the stand-ins (and may have a sitecustomize of its own)
        spec = importlib.util.spec_from_file_location("inverted_sglang_stand_ins", Path(here) / "sitecustomize.py")
        assert spec is not None and spec.loader is not None  # a file that exists, with a .py loader
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    child = os.fork()
    if child == 0:
        os.setpgid(0, 0)  # SGLang and every process it starts: one group, stopped together
        code = 1
        try:
            run_sglang(args)
            code = 0
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:  # never return into the launcher's code
            sys.stderr.flush()
            os._exit(code)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda number, _: stop(child))
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    wait_for_group(child)
    remove_leftovers(scratch, started)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
