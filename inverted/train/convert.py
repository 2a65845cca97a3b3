"""Hugging Face ⇄ Megatron weights: one declarative name table and generic split/merge of fused tensors.

Every Megatron parameter of the decoder is named by one row of ``LAYER_TABLE`` or
``MODEL_TABLE``: its Megatron name, the Hugging Face tensors it is made of, and its layout under
tensor parallelism. The three families share the table; a row whose parameter a model lacks
(q/k/v biases outside Qwen2, q/k norms outside Qwen3, ``output_layer`` when embeddings are tied)
is simply not used. With tied embeddings under pipeline parallelism the last stage holds its own
copy of the embedding as ``output_layer`` (``TIED_OUTPUT``): loaded from the embedding, and left
out when the model is assembled, since the first stage already gives that tensor. Layouts:

- ``replicated``: every TP rank holds the whole tensor (norms).
- ``column`` / ``row``: split along dim 0 / dim 1 (vocab-parallel embedding and LM head are ``column``).
- ``qkv``: Megatron fuses q, k and v *per query group*: for each of the ``G`` groups, that group's
  q heads, then its k head, then its v head. TP ranks take whole groups.
- ``gate_up``: ``linear_fc1`` is ``[gate_r; up_r]``: each rank's slice of gate, then of up.

Mixture-of-Experts layers add the router, Qwen2-MoE's gated shared expert, and one row per expert
(``EXPERT_TABLE``): Megatron numbers an expert-parallel rank's experts from 0
(``mlp.experts.local_experts.{e}``), HF numbers them globally, so the HF name is made with
``e + expert_offset`` (``ep_rank * num_experts / ep_size``).

``to_megatron`` cuts full HF tensors into one rank's shards; ``to_hf`` puts gathered shards back.
They are exact inverses (tested bit for bit), and serve loading, weight sync and ``export-hf``.
``iter_hf_weights`` assembles the whole model on the first pipeline stage: each stage gathers its
parameters over tensor parallelism and sends them there, one tensor at a time.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from inverted.errors import ModelError
from inverted.hf_checkpoint import ModelSpec
from inverted.train.lora import is_adapter
from inverted.train.parallel import all_gathered


@dataclass(frozen=True, slots=True)
class Row:
    megatron: str
    hf: tuple[str, ...]
    layout: str


LAYER_TABLE = (
    Row("input_layernorm.weight", ("input_layernorm.weight",), "replicated"),
    Row(
        "self_attention.linear_qkv.weight",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "qkv",
    ),
    Row(
        "self_attention.linear_qkv.bias",
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        "qkv",
    ),
    Row("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), "replicated"),
    Row("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), "replicated"),
    Row("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), "row"),
    Row("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), "replicated"),
    Row("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up"),
    Row("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), "row"),
    Row("mlp.router.weight", ("mlp.gate.weight",), "replicated"),
    Row(
        "mlp.shared_experts.linear_fc1.weight",
        ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
        "gate_up",
    ),
    Row("mlp.shared_experts.linear_fc2.weight", ("mlp.shared_expert.down_proj.weight",), "row"),
    Row("mlp.shared_experts.gate_weight", ("mlp.shared_expert_gate.weight",), "replicated"),
)
# Per expert: ``{}`` is the local index in the Megatron name and the global one in the HF names.
EXPERT_TABLE = (
    Row(
        "mlp.experts.local_experts.{}.linear_fc1.weight",
        ("mlp.experts.{}.gate_proj.weight", "mlp.experts.{}.up_proj.weight"),
        "gate_up",
    ),
    Row("mlp.experts.local_experts.{}.linear_fc2.weight", ("mlp.experts.{}.down_proj.weight",), "row"),
)
EXPERT_PARAM = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.+)")
MODEL_TABLE = (
    Row("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "column"),
    Row("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"),
    Row("output_layer.weight", ("lm_head.weight",), "column"),
)
TIED_OUTPUT = Row("output_layer.weight", ("model.embed_tokens.weight",), "column")
LAYER_PREFIX = "decoder.layers."


def layer_param(name: str) -> tuple[int, str] | None:
    """``decoder.layers.3.mlp.linear_fc2.weight`` → ``(3, "mlp.linear_fc2.weight")``: the stage-local
    layer number and the rest; None for a parameter outside the layers."""
    if not name.startswith(LAYER_PREFIX):
        return None
    local, _, suffix = name[len(LAYER_PREFIX) :].partition(".")
    return int(local), suffix


def is_expert_param(name: str) -> bool:
    """Whether ``name`` is one expert's parameter (held by one expert-parallel rank only)."""
    layer = layer_param(name)
    return layer is not None and EXPERT_PARAM.fullmatch(layer[1]) is not None


def expert_row(suffix: str, expert_offset: int) -> Row | None:
    """The row of a local expert's parameter (``mlp.experts.local_experts.3.linear_fc1.weight``), its HF
    names numbered globally; None for anything else."""
    if (match := EXPERT_PARAM.fullmatch(suffix)) is None:
        return None
    local, rest = int(match[1]), match[2]
    template = next((r for r in EXPERT_TABLE if r.megatron == "mlp.experts.local_experts.{}." + rest), None)
    if template is None:
        return None
    return Row(suffix, tuple(n.format(local + expert_offset) for n in template.hf), template.layout)


def rows_for(names: list[str], layer_offset: int, tied: bool, expert_offset: int = 0) -> dict[str, tuple[Row, str]]:
    """Each Megatron parameter name → its table row and the HF name prefix (global layer index).

    ``tied``: the model ties its embeddings, so an ``output_layer`` is the last stage's copy of them.
    ``expert_offset``: the global index of this expert-parallel rank's first expert.
    """
    table = {row.megatron: row for row in LAYER_TABLE}
    found: dict[str, tuple[Row, str]] = {}
    for name in names:
        if (layer := layer_param(name)) is not None:
            local, suffix = layer
            row = table.get(suffix) or expert_row(suffix, expert_offset)
            prefix = f"model.layers.{local + layer_offset}."
        else:
            row = (
                TIED_OUTPUT
                if tied and name == TIED_OUTPUT.megatron
                else next((r for r in MODEL_TABLE if r.megatron == name), None)
            )
            prefix = ""
        if row is None:
            raise ModelError(f"Megatron parameter {name!r} has no row in the HF name table (train/convert.py)")
        found[name] = (row, prefix)
    return found


def _qkv_groups(spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q/k/v (heads along dim 0) → ``[G, (q_per_group + 2) * D, ...]``, Megatron's per-group order."""
    groups, dim = spec.num_kv_heads, spec.head_dim
    rest = q.shape[1:]
    return torch.cat(
        [q.reshape(groups, -1, *rest), k.reshape(groups, dim, *rest), v.reshape(groups, dim, *rest)], dim=1
    )


def to_megatron(spec: ModelSpec, row: Row, hf: list[torch.Tensor], tp_size: int, tp_rank: int) -> torch.Tensor:
    """One TP rank's shard of the Megatron parameter made of the full HF tensors ``hf``."""
    if row.layout == "replicated":
        return hf[0]
    if row.layout in ("column", "row"):
        return hf[0].chunk(tp_size, dim=0 if row.layout == "column" else 1)[tp_rank]
    if row.layout == "gate_up":
        return torch.cat([t.chunk(tp_size, dim=0)[tp_rank] for t in hf], dim=0)
    fused = _qkv_groups(spec, *hf).chunk(tp_size, dim=0)[tp_rank]  # qkv: whole groups per rank
    return fused.reshape(-1, *fused.shape[2:])


def to_hf(spec: ModelSpec, row: Row, shards: list[torch.Tensor]) -> list[torch.Tensor]:
    """The full HF tensors of ``row`` from its shards on every TP rank (in rank order)."""
    if row.layout == "replicated":
        return [shards[0]]
    if row.layout in ("column", "row"):
        return [torch.cat(shards, dim=0 if row.layout == "column" else 1)]
    if row.layout == "gate_up":
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    q_per_group = spec.num_heads // spec.num_kv_heads
    dim = spec.head_dim
    groups = torch.cat(shards, dim=0).reshape(spec.num_kv_heads, (q_per_group + 2) * dim, *shards[0].shape[1:])
    q, k, v = groups.split([q_per_group * dim, dim, dim], dim=1)
    return [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]


def check_compatible(
    spec: ModelSpec, tp_size: int, pp_size: int = 1, ep_size: int = 1, sequence_parallel: bool = False
) -> None:
    """Raise ``ModelError`` unless ``spec`` can be split ``tp_size`` ways, cut into ``pp_size`` stages, and
    its experts shared out ``ep_size`` ways."""
    for what, count in (
        ("attention heads", spec.num_heads),
        ("key/value heads", spec.num_kv_heads),
        ("vocabulary entries", spec.vocab_size),
        ("MLP channels", spec.intermediate_size),
        ("expert MLP channels", spec.moe_intermediate_size),
        ("shared expert channels", spec.shared_expert_intermediate_size),
    ):
        if count % tp_size:
            raise ModelError(f"--tensor-model-parallel-size {tp_size} does not divide the model's {count} {what}")
    if spec.num_layers % pp_size:
        raise ModelError(
            f"--pipeline-model-parallel-size {pp_size} does not divide the model's {spec.num_layers} layers"
        )
    if ep_size > 1 and (not spec.is_moe or spec.num_experts % ep_size):
        raise ModelError(
            f"--expert-model-parallel-size {ep_size} does not divide the model's {spec.num_experts} experts"
        )
    # Megatron's MoE layer refuses to train tensor-parallel without it: every TP rank would route
    # and run every token of the sequence.
    if spec.is_moe and tp_size > 1 and not sequence_parallel:
        raise ModelError("tensor parallelism of a Mixture-of-Experts model needs --sequence-parallel")


def base_parameters(model) -> dict[str, torch.nn.Parameter]:
    """The model's own parameters by name: LoRA adapters (``train/lora.py``) are not in the name table."""
    return {name: p for name, p in model.named_parameters() if not is_adapter(name)}


def _layer_offset(model) -> int:
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    return layers[0].layer_number - 1 if layers is not None and len(layers) else 0


def mark_tensor_parallel(model) -> None:
    """Set Megatron's tensor-parallel attributes on every parameter from its table layout.

    Megatron sets ``tensor_model_parallel`` / ``partition_dim`` only inside its weight
    initialisers, which we skip (weights come from the checkpoint). Without them Megatron's
    gradient-norm code would count a sharded weight only on TP rank 0.
    """
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    params = base_parameters(model)
    for name, (row, _) in rows_for(
        list(params), _layer_offset(model), model.share_embeddings_and_output_weights
    ).items():
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):  # biases already have them
            if hasattr(params[name], attr):
                delattr(params[name], attr)
        set_tensor_model_parallel_attributes(
            params[name], row.layout != "replicated", 1 if row.layout == "row" else 0, 1
        )


def expert_offset(spec: ModelSpec, ep_rank: int | None = None, ep_size: int | None = None) -> int:
    """The global index of the first expert of expert-parallel rank ``ep_rank`` of ``ep_size`` (default:
    this rank's, in this process's groups); 0 in a dense model."""
    from megatron.core import parallel_state

    if not spec.is_moe:
        return 0
    rank = parallel_state.get_expert_model_parallel_rank() if ep_rank is None else ep_rank
    size = parallel_state.get_expert_model_parallel_world_size() if ep_size is None else ep_size
    return rank * (spec.num_experts // size)


def load_hf_weights(model, spec: ModelSpec, tensors: dict[str, torch.Tensor]) -> None:
    """Copy full HF tensors into this rank's shards of ``model`` (a ``GPTModel`` stage).

    Every parameter must be found with the shape it should have: a checkpoint of another
    architecture or size fails here, naming the tensor, before any step is taken.
    """
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    expert_tp = (
        (parallel_state.get_expert_tensor_parallel_world_size(), parallel_state.get_expert_tensor_parallel_rank())
        if spec.is_moe
        else tp
    )
    params = base_parameters(model)
    with torch.no_grad():
        rows = rows_for(list(params), _layer_offset(model), spec.tie_word_embeddings, expert_offset(spec))
        for name, (row, prefix) in rows.items():
            missing = [prefix + n for n in row.hf if prefix + n not in tensors]
            if missing:
                raise ModelError(f"checkpoint lacks {missing} (needed for Megatron parameter {name})")
            shard = to_megatron(
                spec, row, [tensors[prefix + n] for n in row.hf], *(expert_tp if is_expert_param(name) else tp)
            )
            if shard.shape != params[name].shape:
                raise ModelError(
                    f"{prefix + row.hf[0]}: checkpoint gives {tuple(shard.shape)} for {name}, "
                    f"the model expects {tuple(params[name].shape)}"
                )
            params[name].copy_(shard)


def assembled_hf(
    spec: ModelSpec, names: list[str], shards_of, layer_offset: int = 0, expert_offset: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF tensors from Megatron parameters, lazily; ``shards_of(name, row)`` gives a parameter's TP shards."""
    for name, (row, prefix) in rows_for(names, layer_offset, spec.tie_word_embeddings, expert_offset).items():
        if row is TIED_OUTPUT:
            continue
        for hf_name, tensor in zip(row.hf, to_hf(spec, row, shards_of(name, row))):
            yield prefix + hf_name, tensor.contiguous()


def _stage_hf_weights(model, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """This pipeline stage's parameters as full HF tensors, gathered over tensor parallelism, and each
    expert's over expert parallelism (every rank of the group holds other experts, under the same names)."""
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    expert_tp_group = parallel_state.get_expert_tensor_parallel_group() if spec.is_moe else tp_group
    ep_size = parallel_state.get_expert_model_parallel_world_size() if spec.is_moe else 1
    params = base_parameters(model)
    layer_offset = _layer_offset(model)

    def shards_of(name: str, row: Row) -> list[torch.Tensor]:
        local, group = params[name].detach(), expert_tp_group if is_expert_param(name) else tp_group
        return [local] if row.layout == "replicated" else all_gathered(local, group)

    for name in params:
        if ep_size == 1 or not is_expert_param(name):
            yield from assembled_hf(spec, [name], shards_of, layer_offset)
            continue
        # Each expert-parallel rank's TP shards of its experts (same names, other experts); no expert
        # row is replicated, so every one is split over the expert-TP group.
        shards = [
            all_gathered(shard, parallel_state.get_expert_model_parallel_group())
            for shard in all_gathered(params[name].detach(), expert_tp_group)
        ]
        for rank in range(ep_size):
            yield from assembled_hf(
                spec,
                [name],
                lambda _name, _row, rank=rank: [s[rank] for s in shards],
                layer_offset,
                expert_offset(spec, rank),
            )


def iter_hf_weights(model, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole policy as full HF tensors on the first pipeline stage, one Megatron parameter at a time.

    Every rank of the model replica (and of a MoE model's expert-parallel group) must iterate, in step:
    the tensor- and expert-parallel gathers are collectives, and each later stage sends its tensors
    (from its TP rank 0) to the first stage, which yields them after its own. The first stage's other TP
    ranks and the later stages yield nothing of the other stages. At most one parameter's full tensors
    exist at a time, so weight sync never holds a second copy of the model.
    """
    from megatron.core import parallel_state

    local = _stage_hf_weights(model, spec)
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return local
    return over_pipeline(local, next(model.parameters()).device)


def over_pipeline(
    local: Iterator[tuple[str, torch.Tensor]], device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """``local`` on the first stage, then each later stage's tensors as its TP rank 0 sends them (name, then tensor)."""
    from megatron.core import parallel_state

    group = parallel_state.get_pipeline_model_parallel_group()
    first, *later = torch.distributed.get_process_group_ranks(group)
    lead = (
        parallel_state.get_tensor_model_parallel_rank() == 0
    )  # speaks for its stage: its TP peers hold the same tensors
    if parallel_state.get_pipeline_model_parallel_rank() > 0:
        for name, tensor in local:
            if lead:
                torch.distributed.send_object_list([(name, tensor.shape, tensor.dtype)], dst=first, group=group)
                torch.distributed.send(tensor, dst=first, group=group)
        if lead:
            torch.distributed.send_object_list([None], dst=first, group=group)
        return
    yield from local
    if not lead:
        return
    for source in later:
        while True:
            header = [None]
            torch.distributed.recv_object_list(header, src=source, group=group)
            if header[0] is None:
                break
            name, shape, dtype = header[0]
            tensor = torch.empty(shape, dtype=dtype, device=device)
            torch.distributed.recv(tensor, src=source, group=group)
            yield name, tensor


def gather_hf_weights(model, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The whole policy as full HF tensors on the first pipeline stage (see ``iter_hf_weights``)."""
    return dict(iter_hf_weights(model, spec))
