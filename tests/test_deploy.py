"""The deployment recipes in ``deploy/`` are checked by their tools' own validators where they exist.

- the Ray cluster config against Ray's cluster-launcher schema (``ray-schema.json``, through Ray's
  own ``validate_config``);
- the KubeRay manifest: every pod template against Kubernetes' own Pod schema
  (``kubernetes-validate``), and the job it runs is a valid ``inverted train`` config;
- the SLURM script with ``bash -n``; the container recipe builds on the official SGLang image and
  copies only what exists.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from inverted.cli import build_parser
from inverted.config import JobConfig, build_section, load_yaml_defaults

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


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


def test_ray_cluster_config_passes_rays_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    validate_config(prepare_config(config))  # what `ray up` does first; raises on any violation
    config["head_start_ray_commands"] = "ray start --head"  # a list of commands, not one
    with pytest.raises(Exception, match="is not of type 'array'"):
        validate_config(prepare_config(config))  # the check is real


def test_kuberay_rayjob_pods_are_valid_kubernetes_and_its_job_a_valid_config(tmp_path):
    config_map, ray_job = yaml.safe_load_all((DEPLOY / "kuberay-rayjob.yaml").read_text())
    version = kubernetes_validate.latest_version()
    kubernetes_validate.validate(config_map, version, strict=True)
    assert ray_job["apiVersion"] == "ray.io/v1" and ray_job["kind"] == "RayJob"
    spec = ray_job["spec"]
    cluster = spec["rayClusterSpec"]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for template in templates:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "check"}, "spec": template["spec"]}
        kubernetes_validate.validate(pod, version, strict=True)
    broken = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "check"},
              "spec": {**templates[0]["spec"], "containers": [{"image": "x"}]}}  # a container needs a name
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)

    assert spec["entrypoint"].startswith("inverted train --config /etc/inverted/job.yaml --ray-address auto")
    job = config_map["data"]["job.yaml"]
    assert job == (ROOT / "examples" / "cluster.yaml").read_text()  # one job, two recipes
    parsed = job_config(job, tmp_path)
    assert parsed.rollout.async_mode and parsed.servers.rollout_backend == "sglang"
    gpus = int(cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    workers = cluster["workerGroupSpecs"][0]["replicas"]
    assert parsed.train.parallel.world_size + parsed.servers.rollout_num_gpus <= gpus * workers  # the job fits the pods


def test_slurm_script_and_container_recipe():
    subprocess.run(["bash", "-n", str(DEPLOY / "slurm.sbatch")], check=True)
    dockerfile = (DEPLOY / "Dockerfile").read_text().splitlines()
    assert any(line.startswith("ARG SGLANG_IMAGE=lmsysorg/sglang:") for line in dockerfile)
    for line in dockerfile:
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), source
