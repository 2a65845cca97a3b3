"""Packed (THD) causal attention in plain PyTorch, as a Megatron-core ``core_attention`` module.

Training batches are packed: the sequences of a micro-batch are laid end to end in one row, with
no padding, and ``PackedSeqParams.cu_seqlens_q`` marks where each starts. Megatron-core's own
``DotProductAttention`` refuses packed input (it is meant for padded ``[s, b]`` batches) and
Transformer Engine, which accepts it, needs CUDA. This module fills that gap with the layer
interface Megatron expects from a core attention, so the spec swaps it in with no patching: one
``scaled_dot_product_attention`` call per sequence, causal within the sequence, never across.
On a CUDA machine with Transformer Engine the model uses TE's fused attention instead
(``train/model.py``); this module is then unused.

The loop needs the sequence lengths as Python ints. ``packed_seq_params`` builds Megatron's
``PackedSeqParams`` with a host copy of them: read off the GPU, they would stall the launch queue
once per layer. The sequences are taken apart with one ``split`` (whose backward is one ``cat``),
not a slice each (whose backwards each zero-fill and copy a whole ``[T, H, D]`` gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class HostPackedSeqParams(PackedSeqParams):
    """``PackedSeqParams`` with the sequence lengths also kept on the host."""

    seqlens: tuple[int, ...] = ()


def packed_seq_params(cu_seqlens: torch.Tensor, max_seqlen: int, device: torch.device | str) -> HostPackedSeqParams:
    """Megatron's packed-sequence parameters for sequences starting at ``cu_seqlens`` (a CPU tensor)."""
    cu = cu_seqlens.to(device)
    return HostPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_seqlen,
                               max_seqlen_kv=max_seqlen, seqlens=tuple((cu_seqlens[1:] - cu_seqlens[:-1]).tolist()))


class PackedAttention(MegatronModule):
    """Causal attention over packed sequences: queries ``[T, Hq, D]``, keys and values ``[T, Hkv, D]``."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("PackedAttention does not split sequences across ranks (context parallelism); "
                             "use Transformer Engine's attention for --context-parallel-size > 1")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"PackedAttention is causal only, got {attn_mask_type}")
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.kv_channels ** -0.5
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                attn_mask_type: AttnMaskType | None = None, attention_bias=None,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        if not isinstance(packed_seq_params, HostPackedSeqParams):
            raise ValueError("PackedAttention expects packed (thd) input, described by attention.packed_seq_params")
        lengths = packed_seq_params.seqlens
        dropout = self.dropout if self.training else 0.0
        outputs = []
        for q, k, v in zip(*(x.split(lengths) for x in (query, key, value))):
            # [T, H, D] -> [1, H, T, D] per sequence: SDPA's fused (flash) kernels take only 4-D input,
            # and 3-D falls back to its math kernel (measured 2x slower training on an H100).
            # GQA heads are shared by SDPA itself.
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                                 is_causal=True, dropout_p=dropout, scale=self.softmax_scale, enable_gqa=True)
            outputs.append(out[0].transpose(0, 1))
        out_THD = torch.cat(outputs, dim=0)
        return out_THD.reshape(out_THD.shape[0], -1)
