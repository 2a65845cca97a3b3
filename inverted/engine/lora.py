"""LoRA in the embedded engine: the loaded adapters, and their share of a batched forward.

An ``Adapter`` is a PEFT LoRA adapter (``peft_adapter``) laid out for ``CausalLM``'s fused
weights. For each layer and fused weight (``qkv``, ``o``, ``gate_up``, ``down``) it keeps the
``A`` matrices of its adapted parts stacked, ``[parts * r, in]``, with the scaling folded in, and
each part's ``B``, placed at that part's output columns: one matmul gives every part's low-rank
input, one more per part its delta; an adapted output layer (``lm_head``) adds its delta to the
logits the same way. Weights stay untouched, so one batch can mix adapters and the base model
(SGLang's ``lora_path`` per request).

``LoRABatch`` is one forward's assignment of rows (decode) or packed tokens (prefill) to
adapters, grouped: each adapter in the batch costs two small matmuls per fused weight on its own
rows, and rows of the base model cost nothing.

``Adapters`` is the registry that SGLang's routes change: ``build`` checks an adapter whole
against the model and the server's limits (``--max-lora-rank``, ``--lora-target-modules``) off
the scheduler thread; ``add`` and ``remove`` run as scheduler commands, between steps, so no
step sees half an adapter. A bad adapter is a ``ModelError`` and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from inverted.engine.config import EngineConfig
from inverted.errors import ConfigError, InvalidRequest, ModelError
from inverted.hf_checkpoint import ModelSpec
from inverted.peft_adapter import HEAD, LoRAConfig, check_tensors, module_shapes, read_adapter, target_modules


def fused_parts(spec: ModelSpec) -> dict[str, tuple[tuple[str, int, int], ...]]:
    """Each fused weight of ``CausalLM`` -> its HF modules and their output columns ``[lo, hi)``."""
    shapes = module_shapes(spec)
    q, kv, inter = shapes["q_proj"][0], shapes["k_proj"][0], spec.intermediate_size
    return {
        "qkv": (("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv)),
        "o": (("o_proj", 0, spec.hidden_size),),
        "gate_up": (("gate_proj", 0, inter), ("up_proj", inter, 2 * inter)),
        "down": (("down_proj", 0, spec.hidden_size),),
    }


@dataclass(slots=True)
class FusedLoRA:
    """One fused weight's adapted parts: their stacked, scaled ``A`` and each part's ``B`` and columns."""

    a: torch.Tensor  # scaling * [A_1; A_2; ...]: [parts * r, in]
    parts: list[tuple[int, int, torch.Tensor]]  # (lo, hi, B [hi - lo, r])


@dataclass(slots=True)
class Adapter:
    name: str
    path: str | None
    pinned: bool
    config: LoRAConfig
    layers: list[dict[str, FusedLoRA]] = field(default_factory=list)  # per layer: fused weight -> its LoRA
    head: FusedLoRA | None = None  # the output layer's
    nbytes: int = 0

    def fused(self, layer: int | None, key: str) -> FusedLoRA | None:
        """The LoRA of one fused weight of a layer (layer None: the output layer's)."""
        return self.head if layer is None else self.layers[layer].get(key)


@dataclass(slots=True)
class LoRABatch:
    """Which rows (or packed tokens) of one forward use which adapter; base-model rows are absent."""

    groups: list[tuple[Adapter, torch.Tensor | None]]  # None: every row

    @classmethod
    def of(cls, adapters: list[Adapter | None], counts: list[int] | None, device: torch.device) -> LoRABatch | None:
        """The batch of rows ``i`` using ``adapters[i]`` (``counts[i]`` consecutive tokens each, for a prefill)."""
        if all(a is None for a in adapters):
            return None
        first = adapters[0]
        if first is not None and all(a is first for a in adapters):
            return cls([(first, None)])
        counts = counts or [1] * len(adapters)
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        rows: dict[int, tuple[Adapter, list[int]]] = {}
        for adapter, lo, hi in zip(adapters, starts, starts[1:]):
            if adapter is not None:
                rows.setdefault(id(adapter), (adapter, []))[1].extend(range(lo, hi))
        return cls([(a, torch.tensor(idx, dtype=torch.long, device=device)) for a, idx in rows.values()])

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int | None, fused: str = "") -> None:
        """``out += x @ (scaling * B @ A).T`` for each row's adapter, on the parts it adapts (layer None:
        the logits, by an adapted output layer)."""
        for adapter, idx in self.groups:
            lora = adapter.fused(layer, fused)
            if lora is None:
                continue
            low = (x if idx is None else x[idx]) @ lora.a.t()
            r = adapter.config.rank
            for k, (lo, hi, b) in enumerate(lora.parts):
                delta = low[:, k * r : (k + 1) * r] @ b.t()
                if idx is None:
                    out[:, lo:hi] += delta
                else:
                    out[idx, lo:hi] += delta


class Adapters:
    """The adapters a server holds, by name, within its LoRA limits."""

    def __init__(
        self,
        spec: ModelSpec,
        dtype: torch.dtype,
        device: torch.device,
        *,
        max_rank: int,
        modules: list[str],
        max_loaded: int | None,
        max_per_batch: int,
    ):
        if spec.is_moe:  # the experts would need adapters of their own; attention alone is not what users ask for
            raise ModelError("LoRA on a Mixture-of-Experts model is not supported by the embedded engine")
        self.spec, self.dtype, self.device = spec, dtype, device
        # SGLang's `all` is every module it adapts, the output layer included (PEFT's leaves it out)
        wanted = list(modules or ["all"])
        self.max_rank, self.modules = max_rank, target_modules(wanted + [HEAD] * ("all" in wanted))
        self.max_loaded, self.max_per_batch = max_loaded, max_per_batch
        self.loaded: dict[str, Adapter] = {}
        self.parts = fused_parts(spec)

    def build(
        self,
        name: str,
        config: dict,
        tensors: dict[str, torch.Tensor],
        *,
        path: str | None = None,
        pinned: bool = False,
    ) -> Adapter:
        """An adapter checked whole against the model and the server's limits; ``ModelError`` if it does not fit."""
        if not isinstance(name, str) or not name or ":" in name:
            raise InvalidRequest(f"lora_name must be a non-empty name without ':', got {name!r}")
        lora = LoRAConfig.from_peft(config)
        if lora.rank > self.max_rank:
            raise ModelError(
                f"LoRA adapter {name!r} has rank {lora.rank}, above this server's --max-lora-rank {self.max_rank}"
            )
        if extra := [m for m in lora.modules if m not in self.modules]:
            raise ModelError(
                f"LoRA adapter {name!r} targets {extra}, outside this server's --lora-target-modules "
                f"{list(self.modules)}"
            )
        pairs = check_tensors(lora, tensors, self.spec)
        # The tensors may be views of the sender's buffer, which it refills for the next update: each
        # is copied once (``cat`` always makes a new tensor), and the scaling goes on the stacked A.
        adapter = Adapter(name, path, pinned, lora)
        for layer in range(self.spec.num_layers):
            fused: dict[str, FusedLoRA] = {}
            for key, parts in self.parts.items():
                if adapted := [(lo, hi, pairs[layer, m]) for m, lo, hi in parts if (layer, m) in pairs]:
                    fused[key] = self._fused(adapted, lora.scaling)
            adapter.layers.append(fused)
        if (None, HEAD) in pairs:
            adapter.head = self._fused([(0, self.spec.vocab_size, pairs[None, HEAD])], lora.scaling)
        adapter.nbytes = sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in pairs.values())
        return adapter

    def _fused(self, adapted: list[tuple[int, int, tuple[torch.Tensor, torch.Tensor]]], scaling: float) -> FusedLoRA:
        """Parts' ``(lo, hi, (A, B))`` as one fused weight's LoRA: the A stacked and scaled, each B copied."""
        a = torch.cat([a for _, _, (a, _) in adapted]).to(self.device, torch.float32).mul_(scaling)
        return FusedLoRA(
            a.to(self.dtype), [(lo, hi, b.to(self.device, self.dtype, copy=True)) for lo, hi, (_, b) in adapted]
        )

    def add(self, adapter: Adapter) -> None:
        if adapter.name in self.loaded:
            raise InvalidRequest(f"LoRA adapter {adapter.name!r} is already loaded: unload it first")
        if self.max_loaded is not None and len(self.loaded) >= self.max_loaded:
            raise InvalidRequest(
                f"{len(self.loaded)} LoRA adapters are loaded, the most this server holds "
                f"(--max-loaded-loras {self.max_loaded}): unload one first"
            )
        self.loaded[adapter.name] = adapter

    def remove(self, name: str) -> None:
        if self.loaded.pop(name, None) is None:
            raise InvalidRequest(f"LoRA adapter {name!r} is not loaded")

    def names(self) -> dict[str, str | None]:
        """SGLang's ``loaded_adapters``: name -> the path it was loaded from (None for tensors)."""
        return {name: a.path for name, a in self.loaded.items()}

    def check_requested(self, names: list[str]) -> None:
        """``InvalidRequest`` unless every adapter a request names is loaded."""
        missing = sorted({n for n in names if n not in self.loaded})
        if missing:
            raise InvalidRequest(
                f"The following requested LoRA adapters are not loaded: {missing}. "
                f"Loaded adapters: {sorted(self.loaded)}."
            )


def startup_adapters(config: EngineConfig, model) -> Adapters:
    """The registry of a server started with ``--enable-lora``, holding the ``--lora-paths`` adapters.

    As in SGLang, the rank limit and the target modules default to what those adapters need
    (the modules to all of them when none is given).
    """
    named = [entry.split("=", 1) if "=" in entry else (entry, entry) for entry in config.lora_paths]
    read = [(name, path, *read_adapter(path)) for name, path in named]
    ranks = [LoRAConfig.from_peft(cfg).rank for _, _, cfg, _ in read]
    max_rank = config.max_lora_rank or max(ranks, default=0)
    if not max_rank:
        raise ConfigError("--enable-lora needs --max-lora-rank (or --lora-paths to infer it from)")
    modules = (
        config.lora_target_modules
        or sorted({m for _, _, cfg, _ in read for m in LoRAConfig.from_peft(cfg).modules})
        or ["all"]
    )
    adapters = Adapters(
        model.spec,
        model.act_dtype,
        model.device,
        max_rank=max_rank,
        modules=modules,
        max_loaded=config.max_loaded_loras,
        max_per_batch=config.max_loras_per_batch,
    )
    for name, path, cfg, tensors in read:
        adapters.add(adapters.build(name, cfg, tensors, path=path, pinned=True))
    return adapters
