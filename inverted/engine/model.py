"""The embedded engine's own forward pass for Qwen2, Qwen3, Llama and Qwen-MoE checkpoints in HF format.

One decoder serves the families; they differ only in flags read from ``config.json``:
Qwen2 has biases on q/k/v, Qwen3 RMS-normalises q and k per head (and decouples ``head_dim``),
Llama may scale RoPE (``llama3`` or ``linear``). Q/K/V and gate/up are fused into one matrix
each so a step runs few, large matmuls. In a Mixture-of-Experts model (Qwen3-MoE, Qwen2-MoE) the
MLP is ``num_experts`` such gate/up and down pairs, stacked; a router's softmax picks the top k
for each token (``_moe``), and Qwen2-MoE adds a shared expert behind a sigmoid gate. The experts
each token was routed to can be kept in the cache beside its keys and values (``KVCache.routes``)
for SGLang's ``return_routed_experts``: the rollout's routing, which the trainer can replay.

``hf_slots`` is the single declarative name table: every Hugging Face parameter name maps to a
``Slot``, a place in the fused tensors, so loading, weight updates and ``get_weights_by_name`` all go
through the same names and never through per-layer converters. On a CPU the matrices that are only
multiplied are held in oneDNN's packed layout (``engine.matmul``), and also as stored where one-row
products are faster from that (measured at the first load); a load unpacks the ones it touches, writes
their slots and packs them again.
LoRA adapters (``engine.lora``) add their deltas to the fused projections' outputs, per row.

Two entry points share the layers: ``prefill`` runs newly admitted requests' tokens (packed into one
forward) into their KV-cache rows; ``decode`` runs one token for each of the first B rows. Rows are kept
compact by the scheduler (``KVCache.move_row``) so a decode step attends over ``cache[:, :B]`` without
gathers. This module owns no scheduling and no HTTP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F

from inverted.engine import matmul
from inverted.engine.lora import LoRABatch
from inverted.errors import ModelError
from inverted.hf_checkpoint import ModelSpec, checkpoint_tensors, rope_angles
from inverted.weight_wire import copy_all, non_finite


class KVCache:
    """Per-row key/value storage, ``[layers, rows, kv_heads, capacity, head_dim]``, grown on demand.

    ``rows x capacity`` never passes ``budget`` positions (``--max-total-tokens``): as the capacity
    grows for a long request, the cache holds fewer rows (the scheduler admits no more requests than
    fit, and forgets kept prefixes in rows that go); when it is idle again, ``reset`` gives the rows
    back. So a model's whole context can be served without one long request costing 64 of them.

    With ``keep_routes`` (a MoE model whose server returns routed experts), each position also holds the
    experts its token was routed to in every layer, ``[rows, capacity, layers, top_k]``, moved with it.
    """

    # Capacity starts here and doubles: a short-prompt job's 64 rows hold 64-128 positions, not a
    # fixed 256 (in fp32, SmolLM2's 64 x 256 are 0.75 GB, most of it never written).
    GROW = 64

    def __init__(
        self,
        spec: ModelSpec,
        rows: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        keep_routes: bool = False,
        budget: int | None = None,
    ):
        self.spec, self.max_rows, self.max_len, self.dtype, self.device = spec, rows, max_len, dtype, device
        self.budget = budget or rows * max_len
        self.rows = self.capacity = 0
        self.k = self.v = torch.empty(0)
        self.keep_routes = keep_routes
        self.routes: torch.Tensor | None = None
        self.reset()

    @staticmethod
    def position_bytes(spec: ModelSpec, dtype: torch.dtype) -> int:
        """Bytes one position of one row takes: a key and a value in every layer."""
        return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * torch.empty(0, dtype=dtype).element_size()

    def rows_for(self, length: int) -> int:
        """How many rows the budget holds at a capacity of ``length``."""
        return min(self.max_rows, self.budget // max(length, 1))

    def reset(self) -> None:
        """Every row back, at the first capacity (an idle engine after a long request)."""
        self.release()
        self.reserve(self.GROW, 1)

    def reserve(self, length: int, in_use: int) -> None:
        """Make room for positions ``< length`` in rows ``< in_use`` (copies the cache when it grows);
        the capacity doubles where the budget lets it, and the rows past what it then holds go."""
        if length <= self.capacity and in_use <= self.rows:
            return
        cap = self.capacity if length <= self.capacity else min(self.max_len, max(length, 2 * self.capacity, self.GROW))
        cap = max(length, min(cap, self.budget // max(in_use, 1)))
        rows = max(in_use, self.rows_for(cap))
        kept_rows, kept_cap = min(rows, self.rows), min(cap, self.capacity)
        shape = (self.spec.num_layers, rows, self.spec.num_kv_heads, cap, self.spec.head_dim)
        k, v = (
            torch.zeros(shape, dtype=self.dtype, device=self.device),
            torch.zeros(shape, dtype=self.dtype, device=self.device),
        )
        if kept_cap:
            k[:, :kept_rows, :, :kept_cap] = self.k[:, :kept_rows, :, :kept_cap]
            v[:, :kept_rows, :, :kept_cap] = self.v[:, :kept_rows, :, :kept_cap]
        if self.keep_routes:  # expert ids fit int16 (at most 32767 experts)
            routes = torch.zeros(
                rows, cap, self.spec.num_layers, self.spec.moe_top_k, dtype=torch.int16, device=self.device
            )
            if kept_cap and self.routes is not None:
                routes[:kept_rows, :kept_cap] = self.routes[:kept_rows, :kept_cap]
            self.routes = routes
        self.k, self.v, self.rows, self.capacity = k, v, rows, cap

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of row ``src`` into row ``dst`` (keeps rows compact)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]
        if self.routes is not None:
            self.routes[dst, :length] = self.routes[src, :length]

    def swap_rows(self, a: int, b: int, length_a: int, length_b: int) -> None:
        """Exchange the first ``length_a`` positions of row ``a`` with the first ``length_b`` of row ``b``."""
        held = self.k[:, a, :, :length_a].clone(), self.v[:, a, :, :length_a].clone()
        own = self.routes
        routes = None if own is None else own[a, :length_a].clone()
        self.move_row(b, a, length_b)
        self.k[:, b, :, :length_a], self.v[:, b, :, :length_a] = held
        if own is not None and routes is not None:
            own[b, :length_a] = routes

    def release(self) -> None:
        """Free the storage (``/release_memory_occupation``); ``reset`` allocates it again."""
        self.k = self.v = torch.empty(0)
        self.routes = None
        self.rows = self.capacity = 0


@dataclass(frozen=True)
class Slot:
    """Where one Hugging Face parameter lives: ``index`` into the tensor held as ``holder.attr``."""

    holder: torch.nn.Module
    attr: str
    index: tuple
    shape: tuple[int, ...]

    @classmethod
    def of(cls, holder: torch.nn.Module, attr: str, *index: int | slice) -> Slot:
        return cls(holder, attr, index, tuple(getattr(holder, attr)[index].shape))

    @property
    def place(self) -> tuple[torch.nn.Module, str]:
        return self.holder, self.attr

    def view(self) -> torch.Tensor:
        """The parameter as a tensor: a view of what is held (a copy where its matrix is held packed)."""
        return matmul.unpack(getattr(self.holder, self.attr))[self.index]


class Layer(torch.nn.Module):
    """One decoder layer's weights, fused: q, k and v in one matrix, gate and up in another. A MoE layer
    holds its router and experts, and its shared expert where it has one (Qwen2-MoE)."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3's per-head norms
    k_norm: torch.Tensor | None
    o: torch.Tensor
    gate_up: torch.Tensor | None  # the dense MLP, or the shared expert
    down: torch.Tensor | None
    router: torch.Tensor
    experts_gate_up: torch.Tensor
    experts_down: torch.Tensor
    shared_gate: torch.Tensor | None


class CausalLM(torch.nn.Module):
    """Decoder weights (fused) plus the two forward entry points."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, stored_rows: int = -1):
        super().__init__()
        self.spec, self.dtype, self.device = spec, dtype, device
        # On CPU, half-precision matmuls are fast (AMX/AVX-512 bf16) but the small element-wise and
        # attention kernels are not: keep the weight matrices in ``dtype`` and everything else
        # (activations, norms, biases, KV cache) in fp32. On GPUs all of it is ``dtype``.
        self.act_dtype = torch.float32 if device.type == "cpu" else dtype
        s = spec
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim

        def param(*shape: int) -> torch.nn.Parameter:
            kind = dtype if len(shape) >= 2 else self.act_dtype  # matrices vs norm weights and biases
            return torch.nn.Parameter(torch.empty(shape, dtype=kind, device=device), requires_grad=False)

        self.embed = param(s.vocab_size, s.hidden_size)
        self.lm_head = self.embed if s.tie_word_embeddings else param(s.vocab_size, s.hidden_size)
        self.norm = param(s.hidden_size)
        self.layers = torch.nn.ModuleList()
        for _ in range(s.num_layers):
            layer = Layer()
            layer.ln1, layer.ln2 = param(s.hidden_size), param(s.hidden_size)
            layer.qkv = param(q + 2 * kv, s.hidden_size)
            layer.qkv_bias = param(q + 2 * kv) if s.qkv_bias else None
            layer.q_norm, layer.k_norm = (param(s.head_dim), param(s.head_dim)) if s.qk_norm else (None, None)
            layer.o = param(s.hidden_size, q)
            if s.is_moe:
                inter, shared = s.moe_intermediate_size, s.shared_expert_intermediate_size
                layer.router = param(s.num_experts, s.hidden_size)
                layer.experts_gate_up = param(s.num_experts, 2 * inter, s.hidden_size)
                layer.experts_down = param(s.num_experts, s.hidden_size, inter)
                layer.gate_up = param(2 * shared, s.hidden_size) if shared else None
                layer.down = param(s.hidden_size, shared) if shared else None
                layer.shared_gate = param(1, s.hidden_size) if shared else None
            else:
                layer.gate_up = param(2 * s.intermediate_size, s.hidden_size)
                layer.down = param(s.hidden_size, s.intermediate_size)
            self.layers.append(layer)
        # cos/sin for every position, once: a step only indexes them.
        angles = rope_angles(spec, torch.arange(spec.max_position_embeddings))
        self.rope_cos, self.rope_sin = angles.cos().to(device, self.act_dtype), angles.sin().to(device, self.act_dtype)
        self.hf_slots = self._hf_slots()
        # The matrices only ever multiplied are held packed for oneDNN on a CPU (``engine.matmul``);
        # they are packed by the first load, as each load leaves them.
        self.packed = (
            {
                (layer, attr)
                for layer in self.layers
                for attr in ("qkv", "o", "gate_up", "down")
                if getattr(layer, attr) is not None
            }
            if matmul.packs(device, dtype)
            else set()
        )
        if self.packed and not s.tie_word_embeddings:  # a tied head is also the embedding's lookup table
            self.packed.add((self, "lm_head"))
        # Products of up to this many rows use each packed matrix's stored copy (``matmul.Stored``);
        # -1: the first load keeps the copies and measures whether they pay. float32 only.
        self.stored_rows = stored_rows if self.packed and dtype == torch.float32 else 0

    def _hf_slots(self) -> dict[str, Slot]:
        """Hugging Face parameter name -> its place in our (fused) parameters."""
        s = self.spec
        q, kv, inter = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.intermediate_size
        slots = {
            "model.embed_tokens.weight": Slot.of(self, "embed"),
            "model.norm.weight": Slot.of(self, "norm"),
            "lm_head.weight": Slot.of(self, "lm_head"),
        }
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            slots.update(
                {
                    p + "input_layernorm.weight": Slot.of(layer, "ln1"),
                    p + "post_attention_layernorm.weight": Slot.of(layer, "ln2"),
                    p + "self_attn.q_proj.weight": Slot.of(layer, "qkv", slice(None, q)),
                    p + "self_attn.k_proj.weight": Slot.of(layer, "qkv", slice(q, q + kv)),
                    p + "self_attn.v_proj.weight": Slot.of(layer, "qkv", slice(q + kv, None)),
                    p + "self_attn.o_proj.weight": Slot.of(layer, "o"),
                }
            )
            if s.is_moe:
                slots.update(self._expert_slots(p + "mlp.", layer))
            else:
                slots.update(
                    {
                        p + "mlp.gate_proj.weight": Slot.of(layer, "gate_up", slice(None, inter)),
                        p + "mlp.up_proj.weight": Slot.of(layer, "gate_up", slice(inter, None)),
                        p + "mlp.down_proj.weight": Slot.of(layer, "down"),
                    }
                )
            if layer.qkv_bias is not None:
                slots.update(
                    {
                        p + "self_attn.q_proj.bias": Slot.of(layer, "qkv_bias", slice(None, q)),
                        p + "self_attn.k_proj.bias": Slot.of(layer, "qkv_bias", slice(q, q + kv)),
                        p + "self_attn.v_proj.bias": Slot.of(layer, "qkv_bias", slice(q + kv, None)),
                    }
                )
            if layer.q_norm is not None:
                slots.update(
                    {
                        p + "self_attn.q_norm.weight": Slot.of(layer, "q_norm"),
                        p + "self_attn.k_norm.weight": Slot.of(layer, "k_norm"),
                    }
                )
        return slots

    def _expert_slots(self, p: str, layer: torch.nn.Module) -> dict[str, Slot]:
        """A sparse MLP's names: the router, every expert's gate/up/down, and Qwen2-MoE's shared expert."""
        inter, shared = self.spec.moe_intermediate_size, self.spec.shared_expert_intermediate_size
        slots = {p + "gate.weight": Slot.of(layer, "router")}
        for e in range(self.spec.num_experts):
            slots.update(
                {
                    f"{p}experts.{e}.gate_proj.weight": Slot.of(layer, "experts_gate_up", e, slice(None, inter)),
                    f"{p}experts.{e}.up_proj.weight": Slot.of(layer, "experts_gate_up", e, slice(inter, None)),
                    f"{p}experts.{e}.down_proj.weight": Slot.of(layer, "experts_down", e),
                }
            )
        if shared:
            slots.update(
                {
                    p + "shared_expert.gate_proj.weight": Slot.of(layer, "gate_up", slice(None, shared)),
                    p + "shared_expert.up_proj.weight": Slot.of(layer, "gate_up", slice(shared, None)),
                    p + "shared_expert.down_proj.weight": Slot.of(layer, "down"),
                    p + "shared_expert_gate.weight": Slot.of(layer, "shared_gate"),
                }
            )
        return slots

    # ---- weights -------------------------------------------------------------------------

    def check_weights(self, named: dict[str, torch.Tensor], *, complete: bool, strict_dtype: bool = False) -> None:
        """Raise ModelError unless every name is ours with the right shape (and, if ``complete``, all are given).

        ``strict_dtype``: every tensor must also come in the served dtype (``--dtype``), as weight
        updates must; a checkpoint on disk is converted instead.
        """
        unknown = sorted(set(named) - set(self.hf_slots))
        if unknown:
            raise ModelError(f"unknown parameter names: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
        for name, tensor in named.items():
            if tuple(tensor.shape) != self.hf_slots[name].shape:
                raise ModelError(f"{name}: expected shape {self.hf_slots[name].shape}, got {tuple(tensor.shape)}")
            if strict_dtype and tensor.dtype != self.dtype:
                raise ModelError(f"{name}: expected dtype {self.dtype} (the served dtype), got {tensor.dtype}")
        if complete:
            optional = {"lm_head.weight"} if self.spec.tie_word_embeddings else set()
            missing = sorted(set(self.hf_slots) - set(named) - optional)
            if missing:
                raise ModelError(f"checkpoint lacks parameters: {missing[:5]}{' ...' if len(missing) > 5 else ''}")

    @torch.no_grad()
    def load_weights(self, named: dict[str, torch.Tensor], *, complete: bool, strict_dtype: bool = False) -> None:
        """Check everything first, then copy (together, and waited for on a GPU, where the sender
        refills a CUDA-IPC bucket as soon as we answer): a bad set of weights changes nothing. A packed
        matrix is unpacked, written and packed again, so a load may name any part of it."""
        self.check_weights(named, complete=complete, strict_dtype=strict_dtype)
        if bad := non_finite(named):
            raise ModelError(
                f"weights with NaN or inf values refused (the served weights are unchanged): "
                f"{bad[:5]}{' ...' if len(bad) > 5 else ''}"
            )
        parts: dict[tuple[torch.nn.Module, str], list[tuple[Slot, torch.Tensor]]] = {}
        for name, tensor in named.items():
            parts.setdefault(self.hf_slots[name].place, []).append((self.hf_slots[name], tensor))
        plain = [part for place, group in parts.items() if place not in self.packed for part in group]
        copy_all([slot.view() for slot, _ in plain], [tensor for _, tensor in plain])
        for (holder, attr), group in parts.items():  # one matrix at a time: a load holds one unpacked copy
            if (holder, attr) in self.packed:
                held = getattr(holder, attr)
                covered = sum(math.prod(slot.shape) for slot, _ in group) == held.numel()
                whole = torch.empty(held.shape, dtype=self.dtype) if covered else matmul.unpack(held)
                copy_all([whole[slot.index] for slot, _ in group], [tensor for _, tensor in group])
                packed = torch.nn.Parameter(matmul.pack(whole), requires_grad=False)
                matmul.keep_stored(packed, whole, self.stored_rows)
                setattr(holder, attr, packed)
        if self.stored_rows < 0:
            self._measure_stored_rows()

    def _measure_stored_rows(self) -> None:
        """After the first load: keep the stored copies for as many rows as they pay on this machine."""
        held = [getattr(holder, attr) for holder, attr in self.packed]
        pairs = [(packed, stored.matrix) for packed in held if (stored := matmul.stored_copy(packed))]
        self.stored_rows = matmul.stored_rows(pairs)
        for packed, matrix in pairs:
            matmul.keep_stored(packed, matrix, self.stored_rows)

    # ---- forward -------------------------------------------------------------------------
    # Activations are 2-D, [tokens, hidden]: a prefill's T tokens or a decode step's B rows. On a
    # CPU every kernel launch costs a thread fork/join, so the layer is written in few of them:
    # residual adds ride in the GEMM (``matmul.linear``), RMSNorm carries its weight, RoPE turns q
    # and k in one go.

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.spec.rms_norm_eps)

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin for ``positions``, shaped ``[T, 1, D]`` to broadcast over heads."""
        half = self.spec.head_dim // 2
        sin = self.rope_sin[positions]
        return self.rope_cos[positions][:, None], torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None]

    def layer(self, li: int) -> Layer:
        return cast(Layer, self.layers[li])

    def _qkv(self, li: int, x_TH: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lora: LoRABatch | None):
        """Roped queries ``[T, Hq, D]``, roped keys and values ``[T, Hkv, D]``."""
        s, layer = self.spec, self.layer(li)
        h = self._norm(x_TH, layer.ln1)
        qkv = matmul.linear(h, layer.qkv, layer.qkv_bias)
        if lora is not None:
            lora.add(qkv, h, li, "qkv")
        qkv = qkv.view(-1, s.num_heads + 2 * s.num_kv_heads, s.head_dim)
        qk, v = qkv[:, : s.num_heads + s.num_kv_heads], qkv[:, s.num_heads + s.num_kv_heads :]
        if layer.q_norm is not None and layer.k_norm is not None:  # Qwen3: per-head RMSNorm of q and k before RoPE
            qk = torch.cat(
                (self._norm(qk[:, : s.num_heads], layer.q_norm), self._norm(qk[:, s.num_heads :], layer.k_norm)), 1
            )
        cos, sin = rope
        half = s.head_dim // 2
        rotated = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)
        qk = torch.addcmul(qk * cos, rotated, sin)
        return qk[:, : s.num_heads], qk[:, s.num_heads :], v

    def _finish_layer(
        self, li: int, x_TH: torch.Tensor, attn_TX: torch.Tensor, lora: LoRABatch | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's output, and in a MoE model each token's routed experts ``[T, top_k]``."""
        layer = self.layer(li)
        x_TH = matmul.linear(attn_TX, layer.o, x_TH)
        if lora is not None:
            lora.add(x_TH, attn_TX, li, "o")
        h = self._norm(x_TH, layer.ln2)
        if self.spec.is_moe:
            return self._moe(layer, h, x_TH)
        assert layer.gate_up is not None and layer.down is not None  # a dense layer's MLP
        gate_up = matmul.linear(h, layer.gate_up)
        if lora is not None:
            lora.add(gate_up, h, li, "gate_up")
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate).mul_(up)
        out = matmul.linear(act, layer.down, x_TH)
        if lora is not None:
            lora.add(out, act, li, "down")
        return out, None

    def _moe(self, layer: Layer, h_TH: torch.Tensor, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x + MoE(h)`` and the experts each token went to.

        Routing follows ``transformers`` (and SGLang): softmax over all experts in fp32, the top k,
        renormalised when ``norm_topk_prob``, then cast to the activations' dtype. Tokens are grouped
        by expert (one sort), so each expert runs one matmul pair over all of its tokens.
        """
        s = self.spec
        probs = torch.softmax(matmul.linear(h_TH, layer.router).float(), dim=-1)
        weights, experts = probs.topk(s.moe_top_k, dim=-1)
        if s.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=s.num_experts).tolist()
        token = order // s.moe_top_k
        grouped = h_TH[token]
        outs, start = [], 0
        for e, count in enumerate(counts):
            if count:
                gate, up = matmul.linear(grouped[start : start + count], layer.experts_gate_up[e]).chunk(2, dim=-1)
                outs.append(matmul.linear(F.silu(gate).mul_(up), layer.experts_down[e]))
                start += count
        routed = torch.cat(outs).mul_(weights.flatten()[order].to(h_TH.dtype)[:, None])
        out = x_TH.index_add(0, token, routed)
        if layer.gate_up is not None:  # Qwen2-MoE's shared expert, gated per token
            assert layer.down is not None and layer.shared_gate is not None
            gate, up = matmul.linear(h_TH, layer.gate_up).chunk(2, dim=-1)
            shared = matmul.linear(F.silu(gate).mul_(up), layer.down)
            out.addcmul_(torch.sigmoid(matmul.linear(h_TH, layer.shared_gate)), shared)
        return out, experts

    def logits(self, hidden_TH: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        """fp32 logits of the final hidden states (``lora``: the rows' adapters, of which an adapted
        output layer adds its delta)."""
        x = self._norm(hidden_TH, self.norm)
        out = matmul.linear(x, self.lm_head)
        if lora is not None:
            lora.add(out, x, None)
        return out.float()

    @torch.no_grad()
    def prefill(
        self, cache: KVCache, rows: list[int], tokens: list[list[int]], starts: list[int], lora: LoRABatch | None = None
    ) -> list[torch.Tensor]:
        """Run several requests' new tokens in one packed forward; return each one's hidden states ``[T_i, H]``.

        Request i's ``tokens[i]`` go to positions ``starts[i]..`` of cache row ``rows[i]``; positions
        before ``starts[i]`` must already hold that row's keys and values (prefix reuse). Token-wise
        work (projections, MLP) runs on all requests at once; attention runs per request. ``lora``
        assigns the packed tokens to adapters.
        """
        lengths = [len(t) for t in tokens]
        ends = [start + n for start, n in zip(starts, lengths)]
        cache.reserve(max(ends), max(rows) + 1)
        x = F.embedding(
            torch.tensor([t for ts in tokens for t in ts], dtype=torch.long, device=self.device), self.embed
        )
        x = x.to(self.act_dtype)
        positions = torch.cat([torch.arange(a, b, device=self.device) for a, b in zip(starts, ends)])
        rope = self._rope_tables(positions)
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        for li in range(len(self.layers)):
            q, k, v = self._qkv(li, x, rope, lora)
            attn = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=self.device)
            for row, start, end, lo, hi in zip(rows, starts, ends, offsets, offsets[1:]):
                cache.k[li, row, :, start:end] = k[lo:hi].transpose(0, 1)
                cache.v[li, row, :, start:end] = v[lo:hi].transpose(0, 1)
                # Query j (at start+j) sees keys 0..start+j.
                mask = (
                    None if start == 0 else torch.ones(hi - lo, end, dtype=torch.bool, device=self.device).tril(start)
                )
                out = F.scaled_dot_product_attention(
                    q[lo:hi].transpose(0, 1)[None],
                    cache.k[li, row : row + 1, :, :end],
                    cache.v[li, row : row + 1, :, :end],
                    attn_mask=mask,
                    is_causal=mask is None,
                    enable_gqa=True,
                )
                attn[lo:hi] = out[0].transpose(0, 1).reshape(hi - lo, -1)
            x, experts = self._finish_layer(li, x, attn, lora)
            if cache.routes is not None and experts is not None:
                for row, start, end, lo, hi in zip(rows, starts, ends, offsets, offsets[1:]):
                    cache.routes[row, start:end, li] = experts[lo:hi].to(torch.int16)
        return [x[lo:hi] for lo, hi in zip(offsets, offsets[1:])]

    @torch.no_grad()
    def decode(
        self, cache: KVCache, tokens: list[int], positions: list[int], lora: LoRABatch | None = None
    ) -> torch.Tensor:
        """One token for each of rows ``0..B-1`` at the given positions (``lora``: their adapters); return
        hidden states ``[B, H]``."""
        s = self.spec
        b, kv_heads, group = len(tokens), s.num_kv_heads, s.num_heads // s.num_kv_heads
        longest = max(positions) + 1
        cache.reserve(longest, b)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        rows = torch.arange(b, device=self.device)
        x = F.embedding(torch.tensor(tokens, dtype=torch.long, device=self.device), self.embed).to(self.act_dtype)
        rope = self._rope_tables(pos)
        # Each row attends over its own length: an additive -inf mask past it, one per (row, kv head).
        past = torch.arange(longest, device=self.device)[None] > pos[:, None]
        bias = torch.zeros(b, longest, dtype=cache.dtype, device=self.device).masked_fill_(past, float("-inf"))
        bias = bias.repeat_interleave(kv_heads, dim=0)[:, None]  # B*Hkv, 1, L
        for li in range(len(self.layers)):
            q, k, v = self._qkv(li, x, rope, lora)
            cache.k[li, rows, :, pos] = k
            cache.v[li, rows, :, pos] = v
            # Grouped-query attention as batched matmuls over (row, kv head): the G query heads of a
            # KV head share its keys, so K and V are never copied out per query head.
            keys = cache.k[li, :b, :, :longest].reshape(b * kv_heads, longest, s.head_dim)
            values = cache.v[li, :b, :, :longest].reshape(b * kv_heads, longest, s.head_dim)
            scores = torch.baddbmm(
                bias, q.reshape(b * kv_heads, group, s.head_dim), keys.transpose(1, 2), alpha=s.head_dim**-0.5
            )
            attn = torch.bmm(torch.softmax(scores, dim=-1), values)  # B*Hkv, G, D
            x, experts = self._finish_layer(li, x, attn.view(b, -1), lora)
            if cache.routes is not None and experts is not None:
                cache.routes[rows, pos, li] = experts.to(torch.int16)
        return x


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device, stored_rows: int = -1) -> CausalLM:
    """Build the model described by ``path/config.json`` and load its weights (``stored_rows``:
    ``CausalLM.stored_rows``)."""
    spec = ModelSpec.from_checkpoint(path)
    model = CausalLM(spec, dtype, device, stored_rows)
    model.load_weights(checkpoint_tensors(path), complete=True)
    return model
