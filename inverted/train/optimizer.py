"""The optimizer: Megatron's on GPU, AdamW with Megatron's conventions on CPU.

On CUDA, ``get_megatron_optimizer`` builds Megatron's optimizer (its distributed optimizer with
``--use-distributed-optimizer``). Megatron's optimizer wrappers allocate their scale and overflow
tensors on CUDA, so on CPU ``CPUAdamW`` does the same job with the same conventions: gradients
are read from Megatron DDP's ``main_grad`` buffers; the global norm counts tensor-parallel
replicas once, leaves out the last pipeline stage's copy of tied embeddings, and is reduced over
the model-parallel group, an expert-parallel rank's experts over the expert-parallel group (as
Megatron's ``clip_grad_norm_fp32`` and its expert-parallel optimizer do); biases and 1-D parameters
get no weight decay. ``step()`` returns ``(success, grad_norm, None)`` like Megatron's.
"""

from __future__ import annotations

import torch

from inverted.train.config import OptimConfig

# Elements squared in fp64 at once for the gradient norm: 16 MB of temporaries, not two fp64 copies
# of the largest gradient (SmolLM2's embedding: 2 x 226 MB, the trainer's peak during a step).
NORM_CHUNK = 1 << 20


class CPUAdamW:
    def __init__(self, cfg: OptimConfig, model: torch.nn.Module) -> None:
        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for name, param in model.named_parameters():
            if param.requires_grad:
                (no_decay if name.endswith(".bias") or param.ndim == 1 else decay).append(param)
        # wd_mult: Megatron's name for a group's share of the weight decay (set_adam reads it)
        groups = [
            {"params": decay, "weight_decay": cfg.weight_decay, "wd_mult": 1.0},
            {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0},
        ]
        self.params = decay + no_decay
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
        self.clip_grad = cfg.clip_grad

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def grad_norm(self) -> float:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        dense, experts = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        for param in self.params:
            if param.grad is not None and param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param):
                # Megatron marks an expert-parallel rank's own experts allreduce=False (their DP group is smaller).
                total = dense if getattr(param, "allreduce", True) else experts
                for chunk in param.grad.reshape(-1).split(NORM_CHUNK):  # not two fp64 copies of a whole gradient
                    total.add_(chunk.double().square().sum())
        torch.distributed.all_reduce(dense, group=parallel_state.get_model_parallel_group())
        if parallel_state.get_expert_model_parallel_world_size() > 1:
            torch.distributed.all_reduce(
                experts, group=parallel_state.get_expert_tensor_model_pipeline_parallel_group()
            )
        return float((dense + experts).sqrt())

    @torch.no_grad()
    def step(self) -> tuple[bool, float, None]:
        for param in self.params:
            param.grad = getattr(param, "main_grad", param.grad)
        norm = self.grad_norm()
        if self.clip_grad > 0 and norm > self.clip_grad:
            for param in self.params:
                if param.grad is not None:
                    param.grad.mul_(self.clip_grad / (norm + 1e-6))
        self.optimizer.step()
        return True, norm, None

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


def set_adam(
    optimizer, lr: float, betas: tuple[float, float], eps: float, weight_decay: float, clip_grad: float
) -> None:
    """The next steps' hyper-parameters, set on a built optimizer (a caller-driven loop picks them per step):
    weight decay on the groups that decay (not biases and norms), clipping off at 0."""
    for group in optimizer.optimizer.param_groups:
        group["lr"], group["betas"], group["eps"] = lr, betas, eps
        group["weight_decay"] = weight_decay * group.get("wd_mult", float(group["weight_decay"] != 0))
    if isinstance(optimizer, CPUAdamW):
        optimizer.clip_grad = clip_grad
    else:
        optimizer.config.clip_grad = clip_grad


def build_optimizer(cfg: OptimConfig, ddp_model: torch.nn.Module, *, bf16: bool):
    if not torch.cuda.is_available():
        return CPUAdamW(cfg, ddp_model)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
    )
    return get_megatron_optimizer(config, [ddp_model])
