"""Routing replay for a Mixture-of-Experts policy: its routers send each token to given experts.

A MoE model's log-probs jump when a token goes to another expert, and the engine and the trainer
route a few tokens differently (other kernels, bf16 against fp32, weights a step apart), so the
train/rollout mismatch of a MoE model grows well past a dense model's. Replay removes that
source; slime's two flags:

- **R3**, ``--use-rollout-routing-replay``: the experts the rollout engine chose. The servers return
  them per token and layer (SGLang's ``return_routed_experts``), the Sample keeps them
  (``rollout_routed_experts``), and every forward of the policy over the rollout routes each token
  as the engine did: the old log-probs and each training step.
- **R2**, ``--use-routing-replay``: the experts the trainer's own forward for the old log-probs
  chose (recorded), replayed by every training step of the rollout, so the policy's routing stays
  put while its weights move. With one optimizer step per rollout there is no such forward, and
  R2 changes nothing: the training forward *is* the old policy.

Only the expert *ids* are replayed. The gate weights over them are recomputed by the trainer's
router from its own logits (Megatron's ``RouterReplay`` in ``REPLAY_FORWARD``: the scores
gathered at the replayed ids, then normalised as the model normalises), so they are the trainer's
weights, differentiable, and the router still learns. SGLang returns ids only, so the engine's
weights are not there to replay; what replay leaves is the gap in those weights (miles measured
it too, #2722). ``bench/routing_replay.py`` measures the mismatch with and without R3.

A packed micro-batch shares each prompt between its responses. The engine keeps routes with the
cached prefix, so a prompt's routing is the same in every sample of it, except where a sample was
retracted across a weight update and its prompt run again on the new weights. Samples share a prompt
only where their records of it agree (``prompt_key``), so each response's record serves. The last
token of a sample is never run by the engine and has no record: it predicts nothing the loss reads,
so it gets experts ``0..k-1``, as does padding. Under sequence parallelism each router sees only its
tensor-parallel rank's share of the row, and replays that share.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import numpy as np
import torch

from inverted.errors import SampleError
from inverted.hf_checkpoint import ModelSpec
from inverted.train.packing import MicroBatch
from inverted.train.parallel import sequence_share
from inverted.types import Sample, decode_routed_experts


def decode_routes(sample: Sample, spec: ModelSpec) -> torch.Tensor:
    """``sample``'s recorded experts as int64 ``[len(tokens) - 1, layers, top_k]``, checked."""
    where = f"sample {sample.index} (group {sample.group_index})"
    if not sample.rollout_routed_experts:
        raise SampleError(
            f"{where}: no rollout_routed_experts, which --use-rollout-routing-replay needs (the rollout "
            "function must ask /generate for return_routed_experts and keep meta_info.routed_experts)"
        )
    try:
        flat = decode_routed_experts(sample.rollout_routed_experts)
    except ValueError as exc:
        raise SampleError(f"{where}: rollout_routed_experts is not base64 of int32 ({exc})") from None
    shape = (len(sample.tokens) - 1, spec.num_layers, spec.moe_top_k)
    if flat.size != np.prod(shape):
        raise SampleError(
            f"{where}: rollout_routed_experts holds {flat.size} expert ids; {len(sample.tokens)} tokens "
            f"need {shape[0]} x {shape[1]} layers x top-{shape[2]} = {np.prod(shape)}"
        )
    if flat.size and (flat.min() < 0 or flat.max() >= spec.num_experts):
        raise SampleError(f"{where}: rollout_routed_experts names experts outside 0..{spec.num_experts - 1}")
    return torch.from_numpy(flat.astype(np.int64)).view(shape)


class RoutingReplay:
    """The policy's routers (Megatron ``TopKRouter``s with a ``RouterReplay``), driven per micro-batch.

    ``rollout(samples)`` takes a rollout's recorded experts (R3); ``with forward(mb,
    "record" | "replay"):`` around a forward of ``mb`` records what its routers choose (R2) or
    routes it by the rollout's experts (R3) or by those recorded for it; outside such a block the
    routers route as usual. ``reset()`` ends the rollout.
    """

    def __init__(self, model: torch.nn.Module, spec: ModelSpec, sequence_parallel: bool = False) -> None:
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplay

        # This stage's routers by global layer; Megatron's class-wide list would also hold other
        # models' (a second Trainer in the process), so it is emptied and never used.
        self.routers = {
            m.layer_number - 1: m.router_replay
            for m in model.modules()
            if isinstance(m, TopKRouter) and m.router_replay is not None
        }
        RouterReplay.clear_global_router_replay_instances()
        self.spec = spec
        self.sequence_parallel = sequence_parallel  # each router sees its tensor-parallel rank's share of a row
        self.samples: list[Sample] = []  # R3: the rollout's, each decoded when first needed (this rank's)
        self.routes: dict[int, torch.Tensor] = {}  # R3: sample index -> [tokens - 1, layers, k]
        self.recorded: dict[int, dict[int, torch.Tensor]] = {}  # R2: id(mb) -> layer -> [T, k]

    def rollout(self, samples: list[Sample]) -> None:
        self.samples, self.routes = samples, {}

    def routes_of(self, index: int) -> torch.Tensor:
        """Sample ``index``'s recorded experts, decoded and checked once."""
        if index not in self.routes:
            self.routes[index] = decode_routes(self.samples[index], self.spec)
        return self.routes[index]

    def prompt_key(self, index: int) -> bytes:
        """What sample ``index``'s prompt must share with another's to be run once: its tokens' experts, as
        a digest (a long prompt's record of a large MoE is tens of MB; every sample's is held at once)."""
        prompt = self.routes_of(index)[: self.samples[index].prompt_length]
        return hashlib.blake2b(prompt.numpy().data, digest_size=16).digest()

    @contextlib.contextmanager
    def forward(self, mb: MicroBatch, action: str) -> Iterator[None]:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if action == "record":
            targets, mode = None, RouterReplayAction.RECORD
        else:  # R3: the rollout's experts; R2: those recorded for mb (none with one optimizer step: route)
            targets = self._from_rollout(mb) if self.samples else self.recorded.get(id(mb))
            mode = RouterReplayAction.REPLAY_FORWARD if targets is not None else None
        for layer, replay in self.routers.items():
            replay.clear_indices()
            if targets is not None:
                replay.set_target_indices(targets[layer])
            if mode is not None:
                replay.set_router_replay_action(mode)
        try:
            yield
        finally:
            if action == "record":
                self.recorded[id(mb)] = {layer: replay.get_recorded_indices() for layer, replay in self.routers.items()}
            for replay in self.routers.values():
                replay.clear_indices()
                replay.clear_router_replay_action()

    def _from_rollout(self, mb: MicroBatch) -> dict[int, torch.Tensor]:
        k = self.spec.moe_top_k
        ids = torch.arange(k).expand(len(mb.tokens_T), self.spec.num_layers, k).clone()
        for index, positions in zip(mb.indices, mb.sequence_positions()):
            ids[positions[:-1]] = self.routes_of(index)
        if self.sequence_parallel:
            ids = sequence_share(ids)
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        ids = ids.to(device)
        return {layer: ids[:, layer] for layer in self.routers}

    def reset(self) -> None:
        self.samples, self.routes, self.recorded = [], {}, {}
