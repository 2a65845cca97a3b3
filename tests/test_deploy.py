"""The deployment recipes in ``deploy/`` are checked by their tools' own validators where they exist.

- the Ray cluster config against Ray's cluster-launcher schema (``ray-schema.json``, through Ray's
  own ``validate_config``) and ``ray up``'s own start-command check (no "will not launch any
  workers"); the job's paths are mounted into its containers;
- the KubeRay manifest: every pod template and the NetworkPolicy against Kubernetes' own schemas
  (``kubernetes-validate``), and the job it runs is a valid ``inverted train`` config; its
  dashboard is reachable by KubeRay and closed to the rest;
- the SLURM script with ``shellcheck``, the container recipe with ``hadolint``; both, and the
  cluster config, run Ray in token mode (docs/deployment.md, "Ray and its token").
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from inverted.cli import build_parser
from inverted.config import build_section, load_yaml_defaults
from inverted.controller.config import JobConfig

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
BIN = Path(sys.executable).parent  # the linters' binaries, installed by the test extras


def job_config(text: str, tmp_path: Path) -> JobConfig:
    """``inverted train --config`` of ``text``, parsed and validated as the job would."""
    path = tmp_path / "job.yaml"
    path.write_text(text)
    parser = build_parser()
    train = parser._subparsers._group_actions[0].choices["train"]
    load_yaml_defaults(train, str(path))
    job = build_section(JobConfig, train.parse_args([]))
    job.validate()
    return job


def test_ray_cluster_config_passes_rays_checks_and_mounts_the_jobs_paths(tmp_path, monkeypatch):
    from ray.autoscaler._private import commands
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    validate_config(prepare_config(config))  # what `ray up` does first; raises on any violation
    warnings = []
    monkeypatch.setattr(commands.cli_logger, "warning", lambda message, *args: warnings.append(message))
    commands.warn_about_bad_start_command(config["head_start_ray_commands"])  # what `ray up` says of the head
    assert warnings == []
    commands.warn_about_bad_start_command(["ray start --head"])
    assert "will not launch any workers" in warnings[0]  # the check is real
    broken = {**config, "head_start_ray_commands": "ray start --head"}  # a list of commands, not one
    with pytest.raises(Exception, match="is not of type 'array'"):
        validate_config(prepare_config(broken))

    mounts = [option.split()[1].split(":")[1] for option in config["docker"]["run_options"] if option.startswith("-v ")]
    job = job_config((ROOT / "examples" / "cluster.yaml").read_text(), tmp_path)
    for path in (job.train.hf_checkpoint, job.buffer.prompt_data, job.train.output_dir):
        assert any(path.startswith(mount + "/") for mount in mounts), path
    starts = config["head_start_ray_commands"][1:] + config["worker_start_ray_commands"][1:]
    assert all(command.startswith("RAY_AUTH_MODE=token ray start") for command in starts)
    assert config["file_mounts"] == {"/root/.ray/auth_token": "~/.ray/auth_token"}


def test_kuberay_rayjob_pods_are_valid_kubernetes_and_its_job_a_valid_config(tmp_path):
    config_map, ray_job, policy = yaml.safe_load_all((DEPLOY / "kuberay-rayjob.yaml").read_text())
    version = kubernetes_validate.latest_version()
    kubernetes_validate.validate(config_map, version, strict=True)
    kubernetes_validate.validate(policy, version, strict=True)
    assert ray_job["apiVersion"] == "ray.io/v1" and ray_job["kind"] == "RayJob"
    spec = ray_job["spec"]
    cluster = spec["rayClusterSpec"]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for template in templates:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "check"}, "spec": template["spec"]}
        kubernetes_validate.validate(pod, version, strict=True)
    broken = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "check"},
        "spec": {**templates[0]["spec"], "containers": [{"image": "x"}]},
    }  # a container needs a name
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)

    # KubeRay's submitter and operator reach the dashboard, so it listens beyond loopback; the policy
    # opens its port to them alone, and the head's other ports to this cluster's pods.
    assert cluster["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    name = ray_job["metadata"]["name"]
    assert policy["spec"]["podSelector"]["matchLabels"] == {
        "ray.io/node-type": "head",
        "ray.io/originated-from-cr-name": name,
    }
    own, submission = policy["spec"]["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": {"ray.io/originated-from-cr-name": name}}}]}
    assert submission["ports"] == [{"protocol": "TCP", "port": 8265}]
    assert [peer["podSelector"]["matchLabels"] for peer in submission["from"]] == [
        {"batch.kubernetes.io/job-name": name},
        {"app.kubernetes.io/name": "kuberay-operator"},
    ]

    assert spec["entrypoint"].startswith("inverted train --config /etc/inverted/job.yaml --ray-address auto")
    job = config_map["data"]["job.yaml"]
    assert job == (ROOT / "examples" / "cluster.yaml").read_text()  # one job, two recipes
    parsed = job_config(job, tmp_path)
    assert parsed.loop.async_mode and parsed.servers.rollout_backend == "sglang"
    gpus = int(
        cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    )
    workers = cluster["workerGroupSpecs"][0]["replicas"]
    assert parsed.train.parallel.world_size + parsed.servers.rollout_num_gpus <= gpus * workers  # the job fits the pods


def test_slurm_script_passes_shellcheck_and_runs_ray_in_token_mode():
    script = DEPLOY / "slurm.sbatch"
    subprocess.run([str(BIN / "shellcheck"), str(script)], check=True)
    broken = script.read_text().replace('"${RUN[@]}" ray start --head', "$RUN ray start --head")
    lint = subprocess.run([str(BIN / "shellcheck"), "-"], input=broken, capture_output=True, text=True)
    assert "SC2086" in lint.stdout  # the check is real: an unquoted word would split
    text = script.read_text()
    assert "export RAY_AUTH_MODE=token" in text and "export RAY_AUTH_TOKEN" in text
    assert text.index("export RAY_AUTH_TOKEN") < text.index("ray start --head")


def test_container_recipe_passes_hadolint_and_builds_on_a_published_sglang_tag():
    dockerfile = DEPLOY / "Dockerfile"
    subprocess.run([str(BIN / "hadolint"), str(dockerfile)], check=True)
    lint = subprocess.run(
        [str(BIN / "hadolint"), "-"], input="FROM ubuntu\nRUN cd /tmp\n", capture_output=True, text=True
    )
    assert "DL3006" in lint.stdout and "DL3003" in lint.stdout  # the check is real
    lines = dockerfile.read_text().splitlines()
    # SGLang publishes CUDA 13 builds of its current releases (-cu130), and CUDA 12 ones up to 0.5.19 (-cu129).
    assert "ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23-cu130" in lines
    assert any("SGLANG_IMAGE=lmsysorg/sglang:v0.5.19-cu129" in line for line in lines)
    for line in lines:
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), source
