"""Routing replay (R3 and R2) and the load-balancing loss of a Mixture-of-Experts policy.

The engine serves the policy with its routers perturbed, so it routes some tokens to other experts
than the trainer would (as a bf16 engine or an engine a step behind does, only more often). With
R3 the trainer routes every token as the engine did and the train/rollout log-prob gap falls;
without it, it does not. Replaying a routing that the trainer would choose anyway changes nothing.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from inverted.config import from_flags
from inverted.errors import ModelError, SampleError
from inverted.hf_checkpoint import ModelSpec
from inverted.tiny_model import perturb_routers
from inverted.train.config import TrainConfig
from inverted.train.parallel import spawn
from inverted.train.routing_replay import decode_routes
from inverted.types import Sample
from tests.train.samples import make_samples
from tests.train.workers import train_each

GAP = "train/train_rollout_logprob_abs_diff"


def rollout(url: str, groups: int = 4, per_group: int = 4) -> list[Sample]:
    """GRPO groups sampled by the engine, each Sample with its log-probs and its routed experts."""
    samples = []
    for group, prompt in enumerate(s.tokens[: s.prompt_length] for s in make_samples(seed=5, groups=groups)[::4]):
        outs = httpx.post(
            url + "/generate",
            timeout=120,
            json={
                "input_ids": [prompt] * per_group,
                "return_logprob": True,
                "return_routed_experts": True,
                "sampling_params": {
                    "max_new_tokens": 12,
                    "ignore_eos": True,
                    "temperature": 1.0,
                    "sampling_seed": group,
                },
            },
        ).json()
        for i, out in enumerate(outs):
            ids = out["output_ids"]
            samples.append(
                Sample(
                    group_index=group,
                    index=group * per_group + i,
                    tokens=prompt + ids,
                    response_length=len(ids),
                    loss_mask=[1] * len(ids),
                    rollout_log_probs=[lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]],
                    weight_versions=["0"] * len(ids),
                    reward=float(i % 2),
                    status=Sample.Status.COMPLETED,
                    rollout_routed_experts=out["meta_info"]["routed_experts"],
                )
            )
    return samples


def configs(path, tmp_path, *flags: dict) -> list[TrainConfig]:
    return [
        from_flags(TrainConfig, **{"hf_checkpoint": str(path), "output_dir": str(tmp_path), "lr": 1e-2, **f})
        for f in flags
    ]


def train(cfgs, samples, tmp_path, ranks: int = 1) -> list[dict]:
    spawn(train_each, ranks, cfgs, samples, str(tmp_path / "metrics.pt"))
    return torch.load(tmp_path / "metrics.pt", weights_only=False)


def test_r3_routes_as_the_engine_did_and_the_mismatch_falls(procs, tiny_model, tmp_path):
    path = tiny_model("qwen3_moe")
    served = perturb_routers(path, tmp_path / "perturbed", scale=0.03)
    samples = rollout(procs.engine(served, "--enable-return-routed-experts").url)
    spec = ModelSpec.from_checkpoint(path)
    assert all(decode_routes(s, spec).shape == (len(s.tokens) - 1, spec.num_layers, 2) for s in samples)
    plain, r3 = train(configs(path, tmp_path, {}, {"use_rollout_routing_replay": True}), samples, tmp_path)
    assert plain[GAP] > 4 * r3[GAP], (plain[GAP], r3[GAP])  # measured: 0.058 and 0.0086
    # TP=2 with sequence parallelism: each rank's routers see half of every row, and replay that half.
    split = {
        "use_rollout_routing_replay": True,
        "tensor_model_parallel_size": 2,
        "sequence_parallel": True,
        "actor_num_gpus_per_node": 2,
    }
    [tp2] = train(configs(path, tmp_path, split), samples, tmp_path, ranks=2)
    for name in (GAP, "train/loss", "train/entropy"):  # abs: how TP splits the sums moves fp32 log-probs ~1e-6
        assert tp2[name] == pytest.approx(r3[name], rel=1e-5, abs=1e-5), name


def test_a_group_split_by_a_weight_update_runs_each_prompt_by_its_own_record(procs, tiny_model, tmp_path):
    """An async job's group across an update: some samples were sampled on the old weights, the others
    were retracted and ran their prompt again on the new ones, so the group's records of its prompt
    disagree. R3 shares a prompt only between samples whose records agree: the tokens the trainer's own
    weights sampled get their rollout log-probs back to fp32 (before, the group's prompt was run once,
    routed by its last sample's record, and the fresh tokens were off by ~1e-2)."""
    path = tiny_model("qwen3_moe")
    old = perturb_routers(path, tmp_path / "old", scale=0.3)
    spec = ModelSpec.from_checkpoint(path)
    stale = rollout(procs.engine(old, "--enable-return-routed-experts").url, groups=2)
    fresh = rollout(procs.engine(path, "--enable-return-routed-experts").url, groups=2)
    samples = []
    for group in range(2):  # fresh and stale in turn, a stale one last
        for i in range(4):
            sample = (stale if i % 2 else fresh)[group * 4 + i]
            if i % 2:
                sample.weight_versions = ["-1"] * sample.response_length  # one step behind the trainer's 0
            samples.append(sample)
    prompt = samples[0].prompt_length
    assert decode_routes(samples[0], spec)[:prompt].ne(decode_routes(samples[1], spec)[:prompt]).any()
    [r3] = train(configs(path, tmp_path, {"use_rollout_routing_replay": True}), samples, tmp_path)
    assert r3["train/fresh_logprob_abs_diff_max"] <= 1e-4, r3["train/fresh_logprob_abs_diff_max"]


def test_replaying_the_routing_the_trainer_would_choose_changes_nothing(procs, tiny_model, tmp_path):
    """R3 from an engine serving the trainer's own weights, and R2 over two optimizer steps at lr 0:
    the replayed experts are the ones the routers pick, so every number equals the plain run's."""
    path = tiny_model("qwen3_moe")
    samples = rollout(procs.engine(path, "--enable-return-routed-experts").url, groups=2)
    two_steps = {"global_batch_size": 4, "lr": 0.0}
    plain, r3, plain2, r2 = train(
        configs(
            path,
            tmp_path,
            {},
            {"use_rollout_routing_replay": True},
            two_steps,
            {**two_steps, "use_routing_replay": True},
        ),
        samples,
        tmp_path,
    )
    assert plain[GAP] <= 1e-4
    for name in ("train/loss", GAP, "train/entropy", "train/grad_norm"):  # abs: two GPU runs differ by ~1e-7
        assert r3[name] == pytest.approx(plain[name], rel=1e-5, abs=1e-6), name
        assert r2[name] == pytest.approx(plain2[name], rel=1e-5, abs=1e-6), name


def test_r2_holds_the_routing_of_the_old_policy_through_the_steps(tiny_model, tmp_path):
    """Four optimizer steps at a large learning rate move the routers; R2 keeps each token on the
    experts the old policy chose, so the later steps' numbers differ from the plain run's."""
    path = tiny_model("qwen3_moe")
    samples = make_samples(seed=3, groups=4)
    steps = {"global_batch_size": 4, "lr": 0.3}
    plain, r2 = train(configs(path, tmp_path, steps, {**steps, "use_routing_replay": True}), samples, tmp_path)
    assert plain["train/optimizer_steps"] == r2["train/optimizer_steps"] == 4
    assert r2["train/loss"] != pytest.approx(plain["train/loss"], rel=1e-4)


def switch_loss(path, samples: list[Sample]) -> float:
    """Megatron's load-balancing loss recomputed from ``transformers``' router logits, for one packed
    micro-batch (a group's prompt once, then its responses): per layer ``E / (k T²) Σ_i P_i c_i``,
    with ``P_i`` expert i's summed router probability and ``c_i`` its routed tokens, averaged over layers.
    About 1 for an even routing (exactly 1 when ``P`` and ``c`` are uncorrelated), E / k when one expert takes all."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rows, groups = [], set()
    for s in samples:
        with torch.no_grad():
            layers = model(torch.tensor([s.tokens]), output_router_logits=True).router_logits
        start = s.prompt_length if s.group_index in groups else 0
        groups.add(s.group_index)
        rows.append(torch.stack(layers)[:, start:])  # [layers, tokens, experts]
    probs = torch.cat(rows, dim=1).softmax(-1)
    k, experts, count = model.config.num_experts_per_tok, probs.shape[-1], probs.shape[1]
    routed = torch.zeros_like(probs).scatter_(-1, probs.topk(k, dim=-1).indices, 1.0)
    return float((probs.sum(1) * routed.sum(1)).sum(-1).mean() * experts / (k * count * count))


def test_the_load_balancing_loss_is_trained_and_reported(tiny_model, tmp_path):
    path = tiny_model("qwen2_moe")
    samples = make_samples(seed=3)
    plain, balanced = train(configs(path, tmp_path, {}, {"moe_aux_loss_coeff": 0.1}), samples, tmp_path)
    assert "train/moe_aux_loss" not in plain
    assert balanced["train/moe_aux_loss"] == pytest.approx(switch_loss(path, samples), rel=1e-5)
    assert balanced["train/loss"] == pytest.approx(plain["train/loss"], rel=1e-5)  # the policy loss alone
    assert balanced["train/grad_norm"] != pytest.approx(plain["train/grad_norm"], rel=1e-4)


def test_replay_without_recorded_experts_or_on_a_dense_model_is_refused(tiny_model):
    spec = ModelSpec.from_checkpoint(tiny_model("qwen3_moe"))
    sample = make_samples(seed=1)[0]
    with pytest.raises(SampleError, match="no rollout_routed_experts, which --use-rollout-routing-replay needs"):
        decode_routes(sample, spec)
    sample.rollout_routed_experts = "AAAAAA=="
    with pytest.raises(SampleError, match="holds 1 expert ids"):
        decode_routes(sample, spec)
    with pytest.raises(ModelError, match="is a dense model"):
        from inverted.train.trainer import Trainer

        Trainer(from_flags(TrainConfig, hf_checkpoint=str(tiny_model("qwen2")), use_rollout_routing_replay=True))
