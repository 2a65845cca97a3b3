"""A real two-node Ray cluster on this machine, started by docs/deployment.md's commands (token
authentication on; a worker joins with the head's token), each node offering custom resources:
the job joins it with ``--ray-address``, puts its trainer on the head and spreads its rollout
servers over both nodes, and when the second node dies it replaces that node's server on the head
and loses no episode. A server that no node can take stops the job with what it needed.

Where the machine allows it (root and ``ip netns``), the second node lives in a network namespace
of its own, joined by a veth pair: its own address, no shared loopback, so the servers' binding,
their admin key and the weight-sync transport (``distributed``: gloo across hosts) are exercised
as on two hosts. Elsewhere both nodes share this machine's loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from inverted.processes import free_port
from tests.job.test_async_and_faults import ROOT, long_tail_data, own_model, processes_with, start_job, wait_for
from tests.job.test_train_job import metrics_rows

pytestmark = pytest.mark.slow  # whole jobs: left out of make test-fast

RAY = str(Path(sys.executable).parent / "ray")


def ray(*args: str, env: dict[str, str], prefix: list[str] | None = None) -> None:
    subprocess.run([*(prefix or []), RAY, *args], check=True, env=env, capture_output=True, timeout=120)


def ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        chain.append(pid)
    return chain


@dataclass
class Cluster:
    address: str  # the head's, for --ray-address
    namespace: str | None  # the second node's network namespace, if it has one
    head_ip: str
    node_ip: str
    temp: str  # on the command line of each of its processes


def make_namespace(tag: str) -> tuple[str, str, str] | None:
    """A network namespace joined to this one by a veth pair: (its name, this side's address, its
    address); None where the machine does not allow it."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return None
    ns, here, there = f"inv-{tag}", f"10.211.{int(tag[:2], 16)}.1", f"10.211.{int(tag[:2], 16)}.2"
    steps = [
        ["netns", "add", ns],
        ["link", "add", f"vh{tag}", "type", "veth", "peer", "name", f"vn{tag}"],
        ["link", "set", f"vn{tag}", "netns", ns],
        ["addr", "add", f"{here}/24", "dev", f"vh{tag}"],
        ["link", "set", f"vh{tag}", "up"],
        ["-n", ns, "addr", "add", f"{there}/24", "dev", f"vn{tag}"],
        ["-n", ns, "link", "set", f"vn{tag}", "up"],
        ["-n", ns, "link", "set", "lo", "up"],
    ]
    for step in steps:
        if subprocess.run(["ip", *step], capture_output=True).returncode:
            remove_namespace(ns, tag)
            return None
    return ns, here, there


def remove_namespace(ns: str, tag: str) -> None:
    for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    subprocess.run(["ip", "link", "del", f"vh{tag}"], capture_output=True)


def join_commands(token: str) -> tuple[dict[str, str], dict[str, str]]:
    """The environments of docs/deployment.md's commands: the head's (its token in its own token
    file), and a worker's (``RAY_AUTH_MODE=token`` and the head's token as ``RAY_AUTH_TOKEN``)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"RAY_USAGE_STATS_ENABLED": "0"}
    return base | {"RAY_AUTH_MODE": "token"}, base | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}


def start_head(home: Path, port: int, ip: str, temp: str, resources: dict[str, int]) -> str:
    """``ray get-auth-token --generate`` then ``RAY_AUTH_MODE=token ray start --head``; the token."""
    head_env, _ = join_commands("")
    head_env["HOME"] = str(home)
    ray("get-auth-token", "--generate", env=head_env)
    ray(
        "start",
        "--head",
        "--port",
        str(port),
        "--node-ip-address",
        ip,
        "--num-cpus",
        "2",
        "--resources",
        json.dumps(resources),
        "--include-dashboard=false",
        "--temp-dir",
        temp,
        env=head_env,
    )
    return (home / ".ray" / "auth_token").read_text().strip()


@pytest.fixture
def cluster(monkeypatch, tmp_path):
    """Head (offering ``train_node`` and ``rollout_node``) and a second node (``rollout_node`` and
    ``second_node``), each joined by docs/deployment.md's commands; stopped after.

    The head has a token of its own (its own home). A plain ``ray start --address`` is refused;
    the documented command joins the worker, whose home holds no token file. The job's home holds a
    stale token file, as one that ran a local job before would: it gets the head's token as
    ``RAY_AUTH_TOKEN`` alone, and turns Ray's token mode on itself.
    """
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # Its own short temp dir (Unix socket paths are short): the processes of this cluster, and only
    # they, carry it on their command lines, so stopping it touches no other Ray on the machine.
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    tag = secrets.token_hex(3)
    namespace = make_namespace(tag)
    ns, head_ip, node_ip = namespace or (None, "127.0.0.1", "127.0.0.1")
    inside = ["ip", "netns", "exec", ns] if ns else []
    port = free_port(head_ip)
    for home in ("head", "worker", "job/.ray"):
        (tmp_path / home).mkdir(parents=True)
    (tmp_path / "job" / ".ray" / "auth_token").write_text(secrets.token_hex(32))  # stale
    try:
        token = start_head(tmp_path / "head", port, head_ip, temp, {"train_node": 1, "rollout_node": 1})
        _, worker_env = join_commands(token)
        join = [
            "start",
            "--address",
            f"{head_ip}:{port}",
            "--node-ip-address",
            node_ip,
            "--num-cpus",
            "2",
            "--resources",
            json.dumps({"rollout_node": 1, "second_node": 1}),
            "--temp-dir",
            temp,
        ]
        plain = {k: v for k, v in worker_env.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
        with pytest.raises(subprocess.CalledProcessError) as refused:  # Ray's worker join: no token mode of its own
            ray(*join, env=plain | {"HOME": str(tmp_path / "worker")}, prefix=inside)
        assert b"AuthenticationError" in refused.value.stderr + refused.value.stdout
        ray(*join, env=worker_env | {"HOME": str(tmp_path / "worker")}, prefix=inside)
        monkeypatch.setenv("RAY_AUTH_TOKEN", token)
        monkeypatch.setenv("HOME", str(tmp_path / "job"))
        yield Cluster(f"{head_ip}:{port}", ns, head_ip, node_ip, temp)
    finally:
        # Ray's client server carries the head's address, not the temp dir, on its command line
        for pid in {*processes_with(temp), *processes_with(f"--address={head_ip}:{port}")}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if ns:
            remove_namespace(ns, tag)
        shutil.rmtree(temp, ignore_errors=True)


def net_namespace(pid: int | str) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def raylet_offering(cluster: Cluster, resource: str) -> int:
    """The raylet of ``cluster``'s node that offers ``resource`` (and no other cluster's)."""
    (pid,) = [
        p
        for p in processes_with(cluster.temp)
        if resource in Path(f"/proc/{p}/cmdline").read_text()
        and "/raylet" in Path(f"/proc/{p}/cmdline").read_text().split("\0")[0]
    ]
    return pid


NO_NODE = """
import sys
from inverted.cli import ray_token_auth
ray_token_auth()  # as inverted train does, before Ray loads
from inverted.errors import ServiceUnavailable
from inverted.placement import ray_launch, start_ray
start_ray(sys.argv[1])
try:
    ray_launch(0, False, "nowhere_node", timeout=5)("engine-9", lambda host, port: ["true"], sys.argv[2], {})
except ServiceUnavailable as error:
    print(error)
"""


def test_servers_spread_over_the_nodes_and_losing_one_node_loses_no_episode(cluster, tiny_model, tmp_path):
    """The job joins with ``--ray-address`` (from another working directory, with relative paths);
    its trainer goes to the node offering ``train_node``, its two servers spread over the two
    nodes offering ``rollout_node``. The second node's raylet is killed mid-rollout: its server is
    replaced on the head, the calls it held are sampled again on the live one, no episode is lost,
    and the job finishes. Then a server that no node can take stops with what it needed.

    The replacement takes ~12 s (its first try goes to the dead node, before Ray knows it is dead),
    and longer with another test beside it: 16 rollouts leave it time to be counted before the job
    ends (with 8 the job once ended first)."""
    model, run_dir = own_model(tiny_model, tmp_path), tmp_path / "run"
    long_tail_data(tmp_path / "long_tail.jsonl", count=64, short_s=1.0, long_s=1.0)
    log = tmp_path / "job.log"
    job = start_job(
        "--hf-checkpoint",
        "model",
        "--prompt-data",
        "long_tail.jsonl",
        "--output-dir",
        "run",
        "--num-rollout",
        "16",
        "--rollout-max-response-len",
        "8",
        "--ray-address",
        cluster.address,
        "--actor-node-resource",
        "train_node",
        "--rollout-node-resource",
        "rollout_node",
        "--num-engines",
        "2",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "2",
        "--lr",
        "1e-3",
        "--env-path",
        "envs.long_tail:episode",
        log=log,
        cwd=tmp_path,
    )
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(metrics_rows(run_dir)) >= 2, job, log, 400)
        second, head = raylet_offering(cluster, "second_node"), raylet_offering(cluster, "train_node")
        engines = processes_with(f"serve-engine --model {model} ")
        assert len(engines) == 2 and {second in ancestors(p) for p in engines} == {True, False}  # one per node
        trainers = [p for p in processes_with("ray::TrainActor") if {head, second} & set(ancestors(p))]
        assert trainers and all(head in ancestors(pid) for pid in trainers)
        (remote,) = [p for p in engines if second in ancestors(p)]
        argv = Path(f"/proc/{remote}/cmdline").read_bytes().split(b"\0")
        engine_url = f"http://{cluster.node_ip}:{int(argv[argv.index(b'--port') + 1])}"
        if cluster.namespace:  # two hosts in all but the kernel: own address, reached over the veth
            assert net_namespace(remote) == os.stat(f"/run/netns/{cluster.namespace}").st_ino
            assert {net_namespace(pid) for pid in trainers} == {net_namespace("self")}
            assert argv[argv.index(b"--host") + 1].decode() == cluster.node_ip
            assert "over distributed" in log.read_text()  # no shared memory across hosts: gloo
        # the servers' weight routes take only the job's key, from anywhere
        assert httpx.post(engine_url + "/update_weights_from_disk", json={"model_path": str(model)}).status_code == 401

        steps_before = len(metrics_rows(run_dir))
        wait_for(lambda: len(metrics_rows(run_dir)) > steps_before, job, log)  # the next rollout starts
        time.sleep(0.5)  # its episodes in flight (each waits 1 s on its tool)
        os.kill(second, signal.SIGKILL)  # the second node is gone, its server with it
        code = job.wait(400)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == 0, text[-4000:]
    rows = [m for m in metrics_rows(run_dir) if "rollout/reward_mean" in m]
    assert len(rows) == 16 and rows[-1]["faults/engine_deaths"] == 1 and rows[-1]["faults/engine_restarts"] == 1
    assert sum(m["rollout/failed"] for m in rows) == 0, text[-4000:]  # no episode lost
    hit = next(m for m in rows if m["faults/engine_deaths"])
    calm = sorted(m["time/rollout_s"] for m in rows[1:] if m is not hit and m["step"] >= steps_before)
    report = {"disturbed_rollout_s": hit["time/rollout_s"], "undisturbed_rollout_s": calm, "episodes_lost": 0}
    (tmp_path / "node_loss.json").write_text(json.dumps(report))
    print("node loss:", json.dumps(report))
    assert hit["time/rollout_s"] < max(calm) + 60, report  # the in-flight episodes' time, not the rollout

    # A server that no node can take fails within its deadline, naming the resource it needed and
    # what the cluster has free (joined as the job joins: the token from RAY_AUTH_TOKEN alone).
    out = subprocess.run(
        [sys.executable, "-c", NO_NODE, cluster.address, str(tmp_path / "engine-9.log")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert (
        "no Ray node took rollout server engine-9 within 5s: it needs 0 GPUs and the resource 'nowhere_node' "
        "(--rollout-node-resource)"
    ) in out.stdout, out.stderr[-3000:]
