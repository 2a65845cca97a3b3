"""Packed (THD) causal attention in plain PyTorch, with shared prompts, as a Megatron-core ``core_attention``.

Training batches are packed: the segments of a micro-batch are laid end to end in one row, with
no padding, and ``PackedSeqParams.cu_seqlens_q`` marks where each starts. A segment is a prompt
and the responses that continue it (``train/packing.py``): the prompt attends causally to itself,
each response to the whole prompt and causally to itself, never to a sibling, so a GRPO group's
prompt is computed once for all its samples and every output equals the unshared sequence's.
Megatron-core's own ``DotProductAttention`` refuses packed input (it is meant for padded
``[s, b]`` batches) and Transformer Engine, which accepts it, needs CUDA. This module fills that
gap with the layer interface Megatron expects from a core attention, so the spec swaps it in with
no patching. On a CUDA machine with Transformer Engine the model uses TE's fused attention (and
plain sequences) instead (``train/model.py``); this module is then unused.

RoPE is applied here, from each token's position, and not by Megatron: Megatron rotates a packed
row sequence by sequence from position 0 (its ``thd`` path splits on ``cu_seqlens``), which
would give a response after its siblings the wrong positions. The model is built without
Megatron's rotary embedding on this path, and ``packed_seq_params`` carries the cos / sin of the
row's positions, computed once per micro-batch for all layers, as ``transformers`` computes them.

The loop needs the lengths as Python ints. ``packed_seq_params`` builds Megatron's
``PackedSeqParams`` with the segments on the host: read off the GPU, they would stall the launch
queue once per layer. The segments are taken apart with one ``split`` (whose backward is one
``cat``), not a slice each (whose backwards each zero-fill and copy a whole ``[T, H, D]`` gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from inverted.hf_checkpoint import ModelSpec, rope_angles
from inverted.train.packing import MicroBatch, Segment


@dataclass
class HostPackedSeqParams(PackedSeqParams):
    """``PackedSeqParams`` with the segments on the host and the rotary cos / sin of the row (``[T, 1, D]``)."""

    segments: tuple[Segment, ...] = ()
    rope: tuple[torch.Tensor, torch.Tensor] | None = None


def packed_seq_params(mb: MicroBatch, device: torch.device | str, rope_of: ModelSpec | None) -> HostPackedSeqParams:
    """Megatron's packed-sequence parameters for ``mb``; with ``rope_of`` (the model's spec), the rotary
    cos / sin of its positions, for ``PackedAttention`` (Transformer Engine's path rotates in Megatron)."""
    cu = mb.cu_seqlens.to(device)
    rope = None
    if rope_of is not None:
        angles = rope_angles(rope_of, mb.positions_T.to(device))[:, None, :]
        rope = (angles.cos(), angles.sin())
    return HostPackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=mb.max_seqlen,
        max_seqlen_kv=mb.max_seqlen,
        segments=tuple(mb.segments),
        rope=rope,
    )


def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """RoPE as ``transformers`` applies it (halves rotated, not interleaved pairs)."""
    cos, sin = (t.to(x.dtype) for t in rope)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def response_mask(segment: Segment, device: torch.device) -> torch.Tensor:
    """Which keys each response query sees: the whole prompt, and its own earlier tokens (``[R, P + R]``)."""
    owner = torch.repeat_interleave(
        torch.arange(len(segment.response_lengths), device=device),
        torch.tensor(segment.response_lengths, device=device),
    )
    index = torch.arange(len(owner), device=device)
    own = (owner[:, None] == owner[None, :]) & (index[None, :] <= index[:, None])
    return torch.cat([own.new_ones(len(owner), segment.prompt_length), own], dim=1)


def _sdpa(q, k, v, dropout: float, scale: float, causal: bool, mask: torch.Tensor | None = None) -> torch.Tensor:
    # [T, H, D] -> [1, H, T, D]: SDPA's fused (flash) kernels take only 4-D input, and 3-D falls back to
    # its math kernel (measured 2x slower training on an H100). GQA heads are shared by SDPA itself.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=causal,
        dropout_p=dropout,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


class PackedAttention(MegatronModule):
    """Causal attention over packed segments: queries ``[T, Hq, D]``, keys and values ``[T, Hkv, D]``."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(
                "PackedAttention does not split sequences across ranks (context parallelism); "
                "use Transformer Engine's attention for --context-parallel-size > 1"
            )
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"PackedAttention is causal only, got {attn_mask_type}")
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.kv_channels**-0.5
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias=None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if not isinstance(packed_seq_params, HostPackedSeqParams):
            raise ValueError("PackedAttention expects packed (thd) input, described by attention.packed_seq_params")
        if packed_seq_params.rope is None:
            raise ValueError(
                "PackedAttention rotates queries and keys itself: build its packed_seq_params with the model's spec"
            )
        query, key = rotate(query, packed_seq_params.rope), rotate(key, packed_seq_params.rope)
        dropout = self.dropout if self.training else 0.0
        outputs = []
        lengths = [s.length for s in packed_seq_params.segments]
        for segment, q, k, v in zip(packed_seq_params.segments, *(x.split(lengths) for x in (query, key, value))):
            if len(segment.response_lengths) <= 1:  # one sequence (or padding): causal throughout
                outputs.append(_sdpa(q, k, v, dropout, self.softmax_scale, causal=True))
                continue
            parts = [segment.prompt_length, len(q) - segment.prompt_length]
            (q_prompt, q_responses), (k_prompt, _), (v_prompt, _) = (x.split(parts) for x in (q, k, v))
            outputs.append(_sdpa(q_prompt, k_prompt, v_prompt, dropout, self.softmax_scale, causal=True))
            outputs.append(
                _sdpa(
                    q_responses, k, v, dropout, self.softmax_scale, causal=False, mask=response_mask(segment, q.device)
                )
            )
        out_THD = torch.cat(outputs, dim=0)
        return out_THD.reshape(out_THD.shape[0], -1)
