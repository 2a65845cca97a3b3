"""The engine's process: one thread runs its torch kernels (a single OpenMP worker pool), and
what startup made is out of the garbage collector's way.

A second pool (a model loaded, or a checkpoint cast, on another thread) makes libgomp stop
spinning between parallel regions for every pool, and a decode step slows by a third (see
``server.launch``). A fresh interpreter serves the real app over loopback HTTP on a thread of its
own, takes a generate and a disk weight update, and then counts the OS threads that neither Python
nor uvloop started. That must equal what one torch thread leaves behind in another fresh
interpreter: torch's own helper, its pthreadpool, and one OpenMP pool. The same interpreter also
reports how many objects startup froze (``processes.freeze_startup_heap``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from inverted.processes import free_port

FOREIGN_THREADS = """
def foreign_threads():
    python_threads = {t.native_id for t in threading.enumerate()}
    names = {int(tid): open(f"/proc/self/task/{tid}/comm").read().strip() for tid in os.listdir("/proc/self/task")}
    return sum(1 for tid, name in names.items() if tid not in python_threads and name != "libuv-worker")
"""

ONE_TORCH_THREAD = (
    """
import json, os, threading
import torch
"""
    + FOREIGN_THREADS
    + """
done = threading.Event()
ran = threading.Event()


def work():
    torch.set_num_threads(2)
    torch.ones(1 << 22).add_(1)
    ran.set()
    done.wait()


threading.Thread(target=work, daemon=True).start()
ran.wait()
print(json.dumps(foreign_threads()))
"""
)

SERVE_AND_COUNT = (
    """
import json, os, sys, threading, time, urllib.request
import uvicorn
from inverted.engine.config import EngineConfig
from inverted.engine.server import create_app
"""
    + FOREIGN_THREADS
    + """

model, port = sys.argv[1], int(sys.argv[2])
url = f"http://127.0.0.1:{port}"
app = create_app(EngineConfig(model=model, port=port, num_threads=2))
server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
serving = threading.Thread(target=server.run, daemon=True)
serving.start()


def post(path, body):
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read() or "null")


for _ in range(600):
    try:
        urllib.request.urlopen(url + "/health", timeout=1)
        break
    except OSError:
        time.sleep(0.1)
generated = post("/generate", {"input_ids": list(range(3, 40)),
                               "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}})
updated = post("/update_weights_from_disk", {"model_path": model})
print(json.dumps({"tokens": len(generated["output_ids"]), "updated": updated["success"], "threads": foreign_threads(),
                  "frozen": __import__("gc").get_freeze_count()}))
server.should_exit = True  # the lifespan stops the scheduler: no thread is left inside torch at exit
serving.join(60)
"""
)


def _last_json(argv: list[str]):
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, "-c", *argv], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_one_openmp_pool_serves_the_whole_engine(tiny_model):
    served = _last_json([SERVE_AND_COUNT, str(tiny_model("qwen2")), str(free_port())])
    assert served["tokens"] == 8 and served["updated"]
    assert served["threads"] == _last_json([ONE_TORCH_THREAD]), "a second thread ran torch kernels in parallel"
    # torch, transformers and the model: far more than anything a request leaves behind
    assert served["frozen"] > 100_000, "startup objects are still walked by every full collection"
