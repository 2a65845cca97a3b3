"""Ray at the edge: start or join a cluster, and run rollout servers where Ray places them.

``start_ray`` joins ``--ray-address`` or starts a local Ray sized to this machine (no dashboard;
its workers at the job's priority, not Ray's default nice 15); a join the cluster refuses for its
token says where the token goes (``cli.ray_token_auth`` turns Ray's token mode on before Ray loads).
``ray_launch`` is a ``Launch`` for ``RolloutServers``: each server process is started by a
``ServerActor`` on the node Ray picks, with the GPUs it needs reserved (``CUDA_VISIBLE_DEVICES``
set by Ray), and the ``RayServer`` handle forwards ``check_alive`` / ``tail`` / ``wait_healthy`` /
``terminate`` to that actor, so the controller supervises a server anywhere in the cluster as it
would a local child. The trainer's ranks are placed by ``inverted.train.actor.TrainGroup``.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path
from typing import Any

import ray

from inverted.errors import ConfigError, ServiceUnavailable
from inverted.processes import ManagedProcess, free_port
from inverted.rollout.servers import ArgvFor, Launch

logger = logging.getLogger(__name__)


def start_ray(address: str | None) -> None:
    if ray.is_initialized():
        return
    if address:
        try:
            ray.init(address=address, logging_level=logging.WARNING)
        except (ray.exceptions.AuthenticationError, ConnectionError) as exc:  # without a token Ray says the latter
            raise ConfigError(
                f"--ray-address {address}: cannot join the cluster ({exc}). If it uses token "
                "authentication, give the head's token as RAY_AUTH_TOKEN, or in ~/.ray/auth_token "
                "(docs/deployment.md, 'Ray and its token')"
            ) from None
    else:
        # A local instance: all cores (fractional requests below keep small jobs schedulable). Ray
        # starts its workers at nice 15, and ours are the engines and the trainer, the job's
        # critical path: at 15, any busy process beside them (an environment's tools, Ray's own
        # daemons) would take their CPU first.
        ray.init(
            num_cpus=os.cpu_count() or 1,
            include_dashboard=False,
            logging_level=logging.WARNING,
            configure_logging=False,
            _system_config={"worker_niceness": 0},
        )
    logger.info("ray %s: %s", "joined" if address else "started locally", ray.cluster_resources())


class ServerActor:
    """Holds one server process on its node."""

    def start(self, name: str, argv_for: ArgvFor, log_path: str, env: dict[str, str], loopback: bool) -> str:
        host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        port = free_port(host)
        self.proc = ManagedProcess.spawn(name, argv_for(host, port), Path(log_path), f"http://{host}:{port}", env)
        return self.proc.url

    def check_alive(self) -> None:
        self.proc.check_alive()

    def tail(self, lines: int = 30) -> str:
        return self.proc.tail(lines)

    def wait_healthy(self, timeout: float, path: str = "/health") -> None:
        self.proc.wait_healthy(timeout, path)

    def terminate(self, grace: float = 10.0) -> None:
        self.proc.terminate(grace)


class RayServer:
    """The controller's handle on a ``ServerActor``: the methods of ``ManagedProcess``, remotely."""

    def __init__(self, actor, name: str, url: str) -> None:
        self.actor, self.name, self.url = actor, name, url

    def _call(self, method: str, *args):
        try:
            return ray.get(getattr(self.actor, method).remote(*args))
        except ray.exceptions.RayActorError as exc:
            raise ServiceUnavailable(f"{self.name}: its Ray actor died: {exc}", url=self.url) from None

    def check_alive(self) -> None:
        self._call("check_alive")

    def tail(self, lines: int = 30) -> str:
        try:
            return self._call("tail", lines)
        except ServiceUnavailable as exc:  # the log was on its node, which may be gone with it
            return f"(no log tail: {exc})"

    def wait_healthy(self, timeout: float, path: str = "/health") -> None:
        self._call("wait_healthy", timeout, path)

    def terminate(self, grace: float = 10.0) -> None:
        try:
            self._call("terminate", grace)
        except ServiceUnavailable:
            pass  # the actor (and its process) are gone already
        ray.kill(self.actor)


def node_resource(name: str | None) -> dict[str, float]:
    """What an actor asks of a node that must offer the custom resource ``name`` (a sliver, so any
    number of actors fit on a node that offers one unit)."""
    return {name: 0.001} if name else {}


def _launch(
    num_gpus: float,
    loopback: bool,
    resource: str | None,
    timeout: float,
    name: str,
    argv_for: ArgvFor,
    log_path: Path,
    env: dict[str, str],
) -> RayServer:
    """Start the server in an actor on a node Ray picks; an actor lost with its node is started again,
    until ``timeout`` seconds have passed without a node that takes it."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        # No CPU reservation: servers mostly wait on I/O or a GPU, and a whole core each would make
        # small machines unschedulable.
        # SPREAD: over every node that can take one (Ray's default packs them onto the head), so
        # that losing a node loses a share of the servers, not all of them.
        actor: Any = (  # Ray's handle: each method is called by its .remote
            ray.remote(ServerActor)
            .options(num_cpus=0, num_gpus=num_gpus, resources=node_resource(resource), scheduling_strategy="SPREAD")
            .remote()
        )
        try:
            url: str = ray.get(actor.start.remote(name, argv_for, str(log_path), env, loopback), timeout=left)
            return RayServer(actor, name, url)
        except ray.exceptions.RayActorError as exc:  # its node died under it (one Ray has not yet marked dead)
            logger.warning("%s: its Ray actor died while starting (%s); placing it again", name, exc)
        except ray.exceptions.GetTimeoutError:
            ray.kill(actor)
            break
    wants = f"{num_gpus:g} GPUs" + (f" and the resource {resource!r} (--rollout-node-resource)" if resource else "")
    raise ServiceUnavailable(
        f"no Ray node took rollout server {name} within {timeout:.0f}s: it needs {wants}; "
        f"the cluster has {ray.available_resources()} free"
    )


def ray_launch(
    num_gpus_per_server: float, loopback: bool, resource: str | None = None, timeout: float = 180.0
) -> Launch:
    """A ``Launch`` that starts each server in its own Ray actor on a node that offers ``resource``
    (``loopback``: bind 127.0.0.1); a server no node takes within ``timeout`` seconds fails."""
    return functools.partial(_launch, num_gpus_per_server, loopback, resource, timeout)
