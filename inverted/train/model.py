"""The policy as a Megatron-core ``GPTModel``, built from a Hugging Face ``config.json``.

Qwen2, Qwen3 and Llama are one decoder with three switches (see ``hf_checkpoint.ModelSpec``):
q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3), and RoPE scaling (Llama 3). Everything else
is shared: RMSNorm, SwiGLU MLP, grouped-query attention, tied or untied embeddings.

A Mixture-of-Experts model (Qwen3-MoE, Qwen2-MoE) swaps the MLP for Megatron's ``MoELayer``: a
``TopKRouter`` in fp32 and the experts as a ``SequentialMLP``, dispatched all-to-all across the
expert-parallel group (gloo on CPU, NCCL on GPU). HF's routing is softmax over all experts, top k,
then renormalised when ``norm_topk_prob``: Megatron's softmax over the top-k logits is the same
thing, and without renormalisation its ``moe_router_pre_softmax`` is. Qwen2-MoE's shared expert is
Megatron's gated shared expert. ``--moe-aux-loss-coeff`` turns on Megatron's load-balancing loss,
and routing replay (``train/routing_replay.py``) gives the policy's routers Megatron's
``RouterReplay``.

Attention takes packed sequences (``thd``: no padding). On CUDA with Transformer Engine installed
the layer spec is Megatron's TE spec; elsewhere it is Megatron's local spec with
``train/attention.PackedAttention`` as its core attention. RoPE inverse frequencies are set from
the checkpoint with the same function the engine uses, since Megatron's built-in Llama 3 scaling
fixes ``original_max_position_embeddings`` at 8192.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inverted.hf_checkpoint import ModelSpec, rope_inv_freq
from inverted.train.config import MoEConfig
from inverted.train.convert import mark_tensor_parallel


@dataclass(frozen=True, slots=True)
class Parallelism:
    """Megatron's model-parallel sizes (data parallelism is whatever the world size leaves)."""

    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1
    sequence: bool = False  # sequence parallelism (Megatron's: only with tensor > 1)


@dataclass(frozen=True, slots=True)
class Recompute:
    """Megatron's activation recomputation: ``full`` saves only a recomputed layer's input for backward
    and runs the layer again there (one more forward of it: memory for time); ``selective``
    recomputes the core attention only."""

    granularity: str = "none"  # "none" | "full" | "selective"
    method: str = "uniform"  # "uniform" | "block"
    num_layers: int = 1

    @classmethod
    def of(cls, granularity: str, method: str, num_layers: int, spec: ModelSpec) -> "Recompute":
        """``auto``: every layer for a dense model on the CPU, where a step's time goes to memory traffic
        more than to arithmetic (measured: the same step time at a third of the peak memory,
        ``bench/train_step.py --memory``); none on a GPU, where it is a third more compute, nor for a
        Mixture-of-Experts model, whose routing replay records each forward's routing."""
        if granularity == "auto":
            granularity = "none" if torch.cuda.is_available() or spec.is_moe else "full"
        return cls(granularity, method, num_layers)

    def megatron(self) -> dict:
        if self.granularity == "none":
            return {}
        if self.granularity == "selective":
            return dict(recompute_granularity="selective")
        return dict(recompute_granularity="full", recompute_method=self.method, recompute_num_layers=self.num_layers)


def use_transformer_engine() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def moe_config(spec: ModelSpec, moe: MoEConfig | None = None, routing_replay: bool = False) -> dict:
    """``TransformerConfig``'s Mixture-of-Experts fields for ``spec`` (none for a dense model).
    ``routing_replay``: the routers get a ``RouterReplay`` (the policy's, not the reference's)."""
    if not spec.is_moe:
        return {}
    moe = moe or MoEConfig()
    shared = spec.shared_expert_intermediate_size
    return dict(
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.moe_top_k,
        moe_ffn_hidden_size=spec.moe_intermediate_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not spec.norm_topk_prob,
        moe_router_dtype="fp32",
        moe_shared_expert_intermediate_size=shared or None,
        moe_shared_expert_gate=bool(shared),
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_load_balancing_type="aux_loss" if moe.moe_aux_loss_coeff else "none",
        moe_aux_loss_coeff=moe.moe_aux_loss_coeff,
        moe_enable_routing_replay=routing_replay,
    )


def transformer_config(
    spec: ModelSpec,
    parallel: Parallelism,
    dtype: torch.dtype,
    moe: MoEConfig | None = None,
    routing_replay: bool = False,
    recompute: Recompute = Recompute(),
):
    """Megatron's ``TransformerConfig`` for ``spec``: the architecture plus parallel sizes, dtype and recomputation."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        **moe_config(spec, moe, routing_replay),
        **recompute.megatron(),
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.intermediate_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        qk_layernorm=spec.qk_norm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=parallel.tensor,
        pipeline_model_parallel_size=parallel.pipeline,
        context_parallel_size=parallel.context,
        expert_model_parallel_size=parallel.expert,
        sequence_parallel=parallel.sequence,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
        # Weights come from the checkpoint; nothing to initialise, and no CUDA to initialise on.
        perform_initialization=False,
        use_cpu_initialization=not torch.cuda.is_available(),
        # Losses arrive normalised over the whole global batch: gradients are summed, never averaged.
        calculate_per_token_loss=True,
        # The fused kernels are CUDA-only; TE picks its own fusions on GPU.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm built as Megatron builds a norm, for the local spec.

    Megatron's own torch wrapper refuses sequence parallelism because it does not mark its weight:
    under it each tensor-parallel rank normalises only its share of the sequence, so the weight's
    gradient is partial and ``finalize_model_grads`` must sum the ``sequence_parallel`` ones.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]  # Megatron's mark


def layer_spec(spec: ModelSpec, te: bool, config):
    """The decoder's spec: Megatron's TE layer spec, or its local spec with ``PackedAttention`` and
    our norms, as the block of this pipeline stage's layers (the final norm is ours too)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=spec.num_experts or None, qk_layernorm=spec.qk_norm
        )
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from inverted.train.attention import PackedAttention

    layer = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=spec.num_experts or None, qk_layernorm=spec.qk_norm, normalization="RMSNorm"
    )
    attention = layer.submodules.self_attention.submodules
    attention.core_attention = PackedAttention
    layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = RMSNorm
    if spec.qk_norm:
        attention.q_layernorm = attention.k_layernorm = RMSNorm
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=RMSNorm)


def build_model(
    spec: ModelSpec,
    parallel: Parallelism,
    dtype: torch.dtype = torch.float32,
    te: bool | None = None,
    moe: MoEConfig | None = None,
    routing_replay: bool = False,
    recompute: Recompute = Recompute(),
):
    """This rank's stage of the policy (pre/post-processing only on the first/last pipeline stage).

    ``te``: Transformer Engine's layer spec (default: where TE can run). LoRA asks for the local spec:
    TE fuses the input LayerNorm into ``linear_qkv``, which hides the normalised input an adapter needs.
    ``moe``: the MoE training options; ``routing_replay``: give the routers Megatron's ``RouterReplay``;
    ``recompute``: which activations backward recomputes instead of keeping.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(spec, parallel, dtype, moe, routing_replay, recompute)
    te = use_transformer_engine() if te is None else te
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(spec, te, config),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        # Without TE, PackedAttention rotates queries and keys itself (train/attention.py).
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope" if te else "none",
        rotary_base=int(spec.rope["rope_theta"]),
        parallel_output=True,
    )
    # Megatron makes its own layers in ``dtype``, on the GPU when there is one; the local spec's norms
    # are torch's, made in fp32 on the CPU. (Megatron's training loop mends this with ``.cuda()`` and
    # its ``Float16Module`` wrapper.) A norm left in fp32 also has no fused kernel for bf16 input.
    model.to(device=torch.cuda.current_device() if torch.cuda.is_available() else "cpu", dtype=dtype)
    mark_tensor_parallel(model)
    if te:
        model.rotary_pos_emb.inv_freq = rope_inv_freq(spec).to(model.rotary_pos_emb.inv_freq.device)
    return model
