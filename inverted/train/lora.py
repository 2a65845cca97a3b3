"""LoRA on Megatron's parallel linears: frozen base weights, trainable low-rank adapters, TP-correct.

Megatron-core has no LoRA, so each adapted linear of a decoder layer gets a ``LoRA`` module
(``linear.lora``) and a forward hook that adds ``scaling * B(A(dropout(x)))`` to its output.
The base weights keep their names, so the name table of ``convert.py`` is untouched, and they
are frozen (``requires_grad=False``): Megatron's DDP gives them no gradient buffer and the
optimizer never sees them.

Adapters follow PEFT's per-module form (``q_proj``, ``k_proj``, ... each with its own ``A``/``B``),
also on Megatron's fused linears, and are placed for tensor parallelism as the layer is split:

- column-parallel (``linear_qkv``, ``linear_fc1``): ``A`` replicated, ``B`` split by output rows.
  The low-rank activations pass ``copy_to_tensor_model_parallel_region`` (identity forward,
  all-reduce backward), so ``A``'s gradient is the whole one on every rank. The parts' outputs
  are laid out as the fused weight is: q/k/v per query group, gate then up per rank.
- row-parallel (``linear_proj``, ``linear_fc2``): ``A`` split by input columns, ``B`` replicated;
  the low-rank activations are summed over TP (``reduce_from_tensor_model_parallel_region``).

- the output layer (``lm_head``, when targeted; on the last pipeline stage): column-parallel over
  the vocabulary, as ``linear_qkv``. The fused head (``logprobs``) never makes the logits: there
  its low-rank activations ride beside the hidden states and the head adds ``B``'s share itself.

Every rank initialises the *whole* ``A`` from a generator seeded by (seed, layer, module) and
keeps its shard, so TP=2 starts (and stays) where TP=1 does. ``B`` starts at zero, as in PEFT:
the untrained adapter is the base model. ``adapter_tensors`` gathers the adapter back into PEFT's
names and full shapes (export, weight sync); ``load_adapter`` shards a PEFT adapter in.

A frozen model runs its linears through Megatron's ``LinearWithFrozenWeight``, whose input
gradient ``attach`` computes on a 2-D view (``_flatten_frozen_dgrad``: twice as fast a LoRA step).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from inverted.errors import ModelError
from inverted.hf_checkpoint import ModelSpec
from inverted.peft_adapter import (
    HEAD,
    MODULES,
    LoRAConfig,
    check_tensors,
    head_shape,
    module_shapes,
    parse_name,
    tensor_name,
)
from inverted.train.parallel import all_gathered

# Megatron linear of a TransformerLayer -> (its TP layout, the HF modules fused into it)
LINEARS = {
    "self_attention.linear_qkv": ("qkv", ("q_proj", "k_proj", "v_proj")),
    "self_attention.linear_proj": ("row", ("o_proj",)),
    "mlp.linear_fc1": ("gate_up", ("gate_proj", "up_proj")),
    "mlp.linear_fc2": ("row", ("down_proj",)),
}
OUTPUT_LAYER = "output_layer"  # the GPTModel's, adapted as HF's lm_head
MARK = ".lora."  # in the name of every adapter parameter


def is_adapter(name: str) -> bool:
    return MARK in name


def split_dim(layout: str, which: str) -> int | None:
    """The dim along which TP splits ``A`` or ``B`` of a linear with ``layout`` (None: replicated)."""
    if layout == "row":
        return 1 if which == "A" else None
    return 0 if which == "B" else None


class LoRA(torch.nn.Module):
    """The adapters of one Megatron linear: ``A.<module>`` and ``B.<module>`` per adapted HF module."""

    def __init__(
        self,
        spec: ModelSpec,
        layout: str,
        modules: tuple[str, ...],
        config: LoRAConfig,
        layer: int | None,
        seed: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        # the projections it adapts (not `modules`: that would hide torch.nn.Module.modules())
        self.spec, self.layout, self.targets, self.config = spec, layout, modules, config
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.enabled = True
        self.in_fused_head = False  # the output layer's, while the fused head applies it (``logprobs``)
        self.A, self.B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        shapes = {**module_shapes(spec), HEAD: head_shape(spec)}
        for module in modules:
            out, inp = shapes[module]
            gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{layer}/{module}".encode()))
            a = (torch.rand(config.rank, inp, generator=gen, dtype=torch.float64) * 2 - 1) / math.sqrt(
                inp
            )  # PEFT's kaiming
            self.A[module] = torch.nn.Parameter(self.shard(a, "A").to(device, dtype))
            self.B[module] = torch.nn.Parameter(self.shard(torch.zeros(out, config.rank), "B").to(device, dtype))
            for which, params in (("A", self.A), ("B", self.B)):
                if (dim := split_dim(layout, which)) is not None:
                    set_tensor_model_parallel_attributes(params[module], True, dim, 1)

    def shard(self, full: torch.Tensor, which: str) -> torch.Tensor:
        """This rank's part of a full (PEFT-shaped) ``A`` or ``B``."""
        dim = split_dim(self.layout, which)
        return full if dim is None else full.chunk(self.tp, dim=dim)[self.tp_rank].contiguous()

    def gather(self, module: str, which: str) -> torch.Tensor:
        """The full (PEFT-shaped) ``A`` or ``B`` of ``module``, from every TP rank (a collective when split)."""
        from megatron.core import parallel_state

        local = (self.A if which == "A" else self.B)[module].detach()
        dim = split_dim(self.layout, which)
        if dim is None or self.tp == 1:
            return local
        return torch.cat(all_gathered(local, parallel_state.get_tensor_model_parallel_group()), dim=dim)

    def local_low(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's low-rank activations ``A(dropout(x))`` of every adapted part, side by side (a
        row-parallel linear's are partial sums: ``low`` sums them over TP)."""
        x = F.dropout(x, self.config.dropout, self.training) if self.config.dropout else x
        a = torch.cat([self.A[m] for m in self.targets]) if len(self.targets) > 1 else self.A[self.targets[0]]
        return x @ a.t()

    def low(self, x: torch.Tensor) -> torch.Tensor:
        """The low-rank activations ``A(dropout(x))`` of every adapted part, side by side (whole over TP)."""
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        low = self.local_low(x)
        if self.layout == "row":
            return reduce_from_tensor_model_parallel_region(low)
        return copy_to_tensor_model_parallel_region(low)

    def products(self) -> tuple[tuple[tuple[slice, slice], ...], list[torch.Tensor]]:
        """How the low-rank activations reach the linear's (local) output: per product, the columns of
        ``low`` it reads, the output columns it adds to, and its scaled ``B`` (``[out cols, low cols]``).

        Gate and up are blocks of columns (per rank), so each has a product of its own. The q/k/v
        heads interleave per query group, so their parts share one ``B`` laid out as the fused weight
        (``qkv_b``), each part reading its own ``rank`` columns of ``low``."""
        r, s = self.config.rank, self.config.scaling
        if self.layout == "gate_up":
            n = self.B[self.targets[0]].shape[0]  # gate's local rows, then up's
            block = {m: i for i, m in enumerate(LINEARS["mlp.linear_fc1"][1])}
            spans = tuple(
                (slice(j * r, (j + 1) * r), slice(block[m] * n, (block[m] + 1) * n)) for j, m in enumerate(self.targets)
            )
            return spans, [self.B[m] * s for m in self.targets]
        b = self.qkv_b() if self.layout == "qkv" else self.B[self.targets[0]] * s
        return ((slice(None), slice(None)),), [b]

    def qkv_b(self) -> torch.Tensor:
        """The q/k/v parts' ``B`` (scaled) as one matrix laid out as the fused weight's local rows, each
        part reading its own ``rank`` columns of the low-rank activations (zeros elsewhere, and for
        parts not adapted): one small product yields the whole fused output."""
        r, k, shapes = self.config.rank, len(self.targets), module_shapes(self.spec)
        blocks = []
        for m in LINEARS["self_attention.linear_qkv"][1]:
            if m in self.targets:
                j = self.targets.index(m)
                blocks.append(F.pad(self.B[m] * self.config.scaling, (j * r, (k - j - 1) * r)))
            else:
                blocks.append(self.B[self.targets[0]].new_zeros(shapes[m][0] // self.tp, k * r))
        groups = self.spec.num_kv_heads // self.tp  # q, k, v rows interleaved per query group
        return torch.cat([b.reshape(groups, -1, k * r) for b in blocks], dim=1).reshape(-1, k * r)


class _AddLowRank(torch.autograd.Function):
    """``out`` plus, for each product, ``low[:, reads] @ B.T`` added to ``out[:, writes]``.

    Each product is written straight into its columns of the result (``addmm`` with ``out=``), so no
    full-size delta is made and added, and gate/up multiply only their own ``rank`` columns. Columns
    no product writes (an MLP with only one of gate/up adapted) are copied."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, low: torch.Tensor, spans: tuple[tuple[slice, slice], ...], *bs: torch.Tensor):
        columns = range(out.shape[-1])
        covered = sum(len(columns[writes]) for _, writes in spans) == len(columns)  # the spans are disjoint
        result = torch.empty_like(out) if covered else out.clone()
        for (reads, writes), b in zip(spans, bs):
            torch.addmm(out[:, writes], low[:, reads], b.t(), out=result[:, writes])
        ctx.spans = spans
        ctx.save_for_backward(low, *bs)
        return result

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        low, *bs = ctx.saved_tensors
        grad_low = torch.zeros_like(low)  # small; every column of it is read in practice
        grad_bs = []
        for (reads, writes), b in zip(ctx.spans, bs):
            torch.mm(grad[:, writes], b, out=grad_low[:, reads])
            grad_bs.append(grad[:, writes].t() @ low[:, reads])
        return grad, grad_low, None, *grad_bs


def _add_delta(linear, inputs, output):
    """The linear's output plus its adapter's ``scaling * B(A(dropout(x)))``."""
    lora = linear.lora
    if not lora.enabled or lora.in_fused_head:
        return output
    out, bias = output
    low = lora.low(inputs[0]).to(out.dtype)
    spans, bs = lora.products()
    flat = _AddLowRank.apply(
        out.reshape(-1, out.shape[-1]), low.reshape(-1, low.shape[-1]), spans, *(b.to(out.dtype) for b in bs)
    )
    return flat.view_as(out), bias


def _frozen_dgrad(ctx, grad_output: torch.Tensor):
    """The input gradient of Megatron's frozen-weight linear, on the gradient flattened to 2-D."""
    (weight,) = ctx.saved_tensors
    grad_input = grad_output.reshape(-1, grad_output.shape[-1]).mm(weight).view(*grad_output.shape[:-1], -1)
    if ctx.allreduce_dgrad:
        torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
    return grad_input, None, None, None, None


def _flatten_frozen_dgrad() -> None:
    """Megatron's ``LinearWithFrozenWeight`` (every linear of a frozen model) takes its input gradient
    as ``grad_output.matmul(weight)`` on the 3-D gradient. The output layer's arrives as ``[s, 1, vocab]``
    with the strides of a transposed ``[1, s, vocab]``, which ``matmul`` cannot fold into one matrix
    product: it ran a batched one, 6.8 s of a 15 s SmolLM2 step on CPU, where one ``mm`` takes ~0.25 s.
    Flattened to 2-D first, as Megatron's trainable-weight linear does, it is that one ``mm``."""
    from megatron.core.tensor_parallel import layers

    layers.LinearWithFrozenWeight.backward = staticmethod(layers.custom_bwd(_frozen_dgrad))


def attach(model, spec: ModelSpec, config: LoRAConfig, seed: int) -> None:
    """Freeze ``model`` (a ``GPTModel`` stage) and give each targeted linear of its layers an adapter."""
    _flatten_frozen_dgrad()
    model.requires_grad_(False)
    param = next(model.parameters())
    for layer in model.decoder.layers:
        for path, (layout, fused) in LINEARS.items():
            modules = tuple(m for m in fused if m in config.modules)
            if not modules:
                continue
            linear = layer.get_submodule(path)
            linear.lora = LoRA(spec, layout, modules, config, layer.layer_number - 1, seed, param.dtype, param.device)
            linear.register_forward_hook(_add_delta)
    if HEAD in config.modules and model.post_process:
        head = getattr(model, OUTPUT_LAYER)
        head.lora = LoRA(spec, "column", (HEAD,), config, None, seed, param.dtype, param.device)
        head.register_forward_hook(_add_delta)
    if model.pre_process:
        # The frozen embedding's output needs no gradient, but a recomputed layer (Megatron's checkpoint
        # is reentrant) runs its backward only when an input requires one: without it the adapters
        # inside would get none. (PEFT's ``enable_input_require_grads``, for the same reason.)
        model.embedding.register_forward_hook(lambda module, args, output: output.requires_grad_(True))


def adapters(model) -> Iterator[tuple[int | None, LoRA]]:
    """``(global layer index, LoRA)`` of every adapted linear of this stage (the output layer's: None)."""
    for layer in model.decoder.layers:
        for path in LINEARS:
            linear = layer.get_submodule(path)
            if hasattr(linear, "lora"):
                yield layer.layer_number - 1, linear.lora
    head = getattr(model, OUTPUT_LAYER, None)
    if head is not None and hasattr(head, "lora"):
        yield None, head.lora


@contextlib.contextmanager
def disabled(model) -> Iterator[None]:
    """The base model: every adapter off (the KL reference of a LoRA run, with no second model)."""
    found = [lora for _, lora in adapters(model)]
    for lora in found:
        lora.enabled = False
    try:
        yield
    finally:
        for lora in found:
            lora.enabled = True


def adapter_tensors(model) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's adapter as full tensors with PEFT's names (every TP rank must iterate: gathers)."""
    for layer, lora in adapters(model):
        for module in lora.targets:
            for which in ("A", "B"):
                yield tensor_name(layer, module, which), lora.gather(module, which).contiguous()


def load_adapter(model, spec: ModelSpec, config: LoRAConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Copy a PEFT adapter's full tensors into this stage's shards (every pair this stage adapts must be there)."""
    pairs = check_tensors(config, tensors, spec)
    with torch.no_grad():
        for layer, lora in adapters(model):
            for module in lora.targets:
                if (layer, module) not in pairs:
                    raise ModelError(
                        f"--lora-adapter-path lacks {module}{'' if layer is None else f' of layer {layer}'}"
                    )
                a, b = pairs[layer, module]
                lora.A[module].copy_(lora.shard(a, "A"))
                lora.B[module].copy_(lora.shard(b, "B"))


def adapter_from_shards(shards: list[dict[str, torch.Tensor]], layer_offset: int) -> dict[str, torch.Tensor]:
    """One pipeline stage's adapter in PEFT's names and full shapes, from its TP ranks' saved state dicts."""
    full: dict[str, torch.Tensor] = {}
    for name in shards[0]:
        if not is_adapter(name):
            continue
        layer_path, _, rest = name.partition(MARK)
        which, module = rest.split(".")
        if layer_path == OUTPUT_LAYER:
            layer, layout = None, "column"
        else:
            local, _, path = layer_path.removeprefix("decoder.layers.").partition(".")
            layer, layout = int(local) + layer_offset, LINEARS[path][0]
        dim = split_dim(layout, which)
        tensor = shards[0][name] if dim is None else torch.cat([s[name] for s in shards], dim=dim)
        full[tensor_name(layer, module, which)] = tensor
    return full


def merged(
    base: dict[str, torch.Tensor], config: LoRAConfig, adapter: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """HF weights with the adapter folded in: ``W + scaling * B @ A`` for each adapted module (in fp32).
    An adapted output layer of a model that ties it to the embedding becomes a weight of its own
    (``lm_head.weight``: the embedding plus the delta); the caller unties the config."""
    out = dict(base)
    for name, a in adapter.items():
        layer, module, which = parse_name(name)
        if which != "A":
            continue
        weight = "lm_head.weight" if layer is None else f"model.layers.{layer}.{MODULES[module]}.{module}.weight"
        w = base.get(weight, base["model.embed_tokens.weight"]) if layer is None else base[weight]
        b = adapter[tensor_name(layer, module, "B")]
        out[weight] = (w.float() + config.scaling * (b.float() @ a.float())).to(w.dtype)
    return out
