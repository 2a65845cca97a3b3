"""Packed (THD) causal attention in plain PyTorch, as a Megatron-core ``core_attention`` module.

Training batches are packed: the sequences of a micro-batch are laid end to end in one row, with
no padding, and ``PackedSeqParams.cu_seqlens_q`` marks where each starts. Megatron-core's own
``DotProductAttention`` refuses packed input (it is meant for padded ``[s, b]`` batches) and
Transformer Engine, which accepts it, needs CUDA. This module fills that gap with the layer
interface Megatron expects from a core attention, so the spec swaps it in with no patching: one
``scaled_dot_product_attention`` call per sequence, causal within the sequence, never across.
On a CUDA machine with Transformer Engine the model uses TE's fused attention instead
(``train/model.py``); this module is then unused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


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
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("PackedAttention expects packed (thd) input with cu_seqlens")
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        dropout = self.dropout if self.training else 0.0
        outputs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            # [T, H, D] -> [H, T, D] per sequence; GQA heads are shared by SDPA itself.
            q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout,
                                                 scale=self.softmax_scale, enable_gqa=True)
            outputs.append(out.transpose(0, 1))
        out_THD = torch.cat(outputs, dim=0)
        return out_THD.reshape(out_THD.shape[0], -1)
