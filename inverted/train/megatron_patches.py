"""Megatron-core on a machine without CUDA: the few places where megatron-core 0.16 assumes a GPU.

Megatron-core is written for CUDA. Its model code (``GPTModel``, the tensor-parallel layers,
Megatron DDP) runs on CPU tensors over gloo once two assumptions are answered. ``apply()``
installs the workarounds and is called only when ``torch.cuda.is_available()`` is false; the GPU
path takes only ``apply_without_te`` (below). It is pinned to the megatron-core versions it was written
against (``_SUPPORTED``): a new release must be checked before it is admitted.
``tests/train/test_megatron_patches.py`` exercises each workaround (the MoE ones: ``tests/train/test_moe.py``).

1. ``torch.cuda.current_device()`` picks the device of parameters, DDP grad buffers and the
   ``GlobalMemoryBuffer`` scratch space; without CUDA it raises. We answer with the CPU.
2. The RNG tracker (``CudaRNGStatesTracker``) saves and restores CUDA generator states around
   tensor-parallel initialization and dropout; we install a subclass doing the same with the CPU
   generator (``model_parallel_cuda_manual_seed`` then seeds it as usual; ``torch.cuda.manual_seed``
   itself is a lazy no-op without CUDA).
3. Pipeline parallelism: ``Tensor.cuda()`` (the tied output layer's first copy of the embedding
   on the last stage) stays on the CPU; ``torch.cuda.synchronize()`` (between the point-to-point
   exchanges of the schedule) has no stream to wait for; and the schedules' token counter
   ``torch.zeros(..., device="cuda")`` is made on the CPU, through a ``torch`` seen only by
   Megatron's ``schedules`` module.

4. Mixture-of-Experts: the all-to-all token dispatcher makes a ``torch.cuda.Stream`` for its
   device-to-host copies of the split sizes and waits on an event from it. On the CPU there is
   nothing to copy: its hook turns the split sizes into the numpy arrays the dispatcher expects,
   with no stream and no event.

5. Gloo gathers and reduce-scatters equal shares only. With tensor and expert parallelism
   together the dispatcher gathers each rank's tokens over the expert-TP group, and scatters their
   outputs back, in shares as uneven as the routing; our versions pad every share to the largest.

6. Activation recomputation (``--recompute-granularity``): Megatron's checkpoint function saves
   the CUDA generator's state beside the CPU one's and the tracker's, and restores all three
   before it recomputes. There is no CUDA generator: its state is nothing, and restoring nothing
   does nothing (the CPU generator and our tracker's states are still saved and restored).

One workaround is not about CPUs and is applied on every machine (``apply_without_te``): MoE's
``moe_utils`` names ``te_general_gemm`` only when Transformer Engine imports, yet tests it for
``None`` in the router's matmul, so a MoE forward without TE raises ``NameError`` on a GPU as on a
CPU (found on an H200): we define it as None.

Not patched, but avoided: Megatron's optimizer wrappers and gradient clipping allocate CUDA
tensors, so on CPU ``train/optimizer.py`` uses AdamW with Megatron's conventions; and Megatron's
``DotProductAttention`` does not take packed sequences, so the local spec gets
``train/attention.PackedAttention``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types

import torch

logger = logging.getLogger(__name__)

_SUPPORTED = ("0.16.",)


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _on_cpu(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


def _no_stream(device=None) -> None:
    return None


class _TorchOnCPU(types.ModuleType):
    """``torch`` as Megatron's pipeline schedules see it: tensors asked for on "cuda" are made on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*size, device=None, **kwargs) -> torch.Tensor:
        return torch.zeros(*size, device="cpu" if device == "cuda" else device, **kwargs)


def _no_cuda_rng_state(*args, **kwargs) -> None:
    return None


def _cpu_rng_tracker():
    """A ``CudaRNGStatesTracker`` whose named states live in the CPU generator.

    Megatron forks a named generator state around tensor-parallel initialization and dropout so
    that ranks draw the same or different numbers as they must; the CPU generator serves the same
    purpose here. Subclassing keeps Megatron's own ``isinstance`` checks (checkpointing the RNG
    states) working.
    """
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    class CPURNGStatesTracker(CudaRNGStatesTracker):
        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_ or name in self.states_:
                raise RuntimeError(f"RNG state {name!r} or seed {seed} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            outside = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outside)

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng"):
            if name not in self.states_:
                raise RuntimeError(f"RNG state {name!r} is not added")
            outside = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outside)

    return CPURNGStatesTracker()


def _dtoh_without_streams(self, point: str, tokens_per_expert=None):
    """``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` for CPU tensors: the same values, no streams."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:

        def host(value, as_numpy: bool = False):
            return value.numpy() if as_numpy and torch.is_tensor(value) else value

        self.input_splits = host(self.input_splits, True)
        self.output_splits = host(self.output_splits, True)
        self.output_splits_tp = host(self.output_splits_tp, True)
    return tokens_per_expert


def _even_for_gloo(gather, reduce_scatter):
    """Megatron's ``_gather_along_first_dim`` and ``_reduce_scatter_along_first_dim`` for uneven shares
    over gloo: each share padded to the largest, the collective run on equal shares, the padding cut."""

    def padded(parts: list[torch.Tensor], most: int) -> torch.Tensor:
        out = parts[0].new_zeros(most * len(parts), *parts[0].shape[1:])
        for i, part in enumerate(parts):
            out[i * most : i * most + len(part)] = part
        return out

    @functools.wraps(gather)
    def gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        out = input_.new_empty(max(sizes) * len(sizes), *input_.shape[1:])
        torch.distributed.all_gather_single(out, padded([input_], max(sizes)), group=group)
        return torch.cat([share[:n] for share, n in zip(out.chunk(len(sizes)), sizes)])

    @functools.wraps(reduce_scatter)
    def reduce_scatter_uneven(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(n) for n in input_split_sizes]
        out = input_.new_empty(max(sizes), *input_.shape[1:])
        torch.distributed.reduce_scatter_single(out, padded(list(input_.split(sizes)), max(sizes)), group=group)
        return out[: sizes[group.rank()]]

    return gather_uneven, reduce_scatter_uneven


def apply_without_te() -> None:
    """Megatron's MoE router without Transformer Engine, on any device: the name it tests must exist."""
    from megatron.core.transformer.moe import moe_utils

    if not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def apply() -> None:
    """Install the CPU workarounds (idempotent). Call before building any Megatron module."""
    import megatron.core
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    version = megatron.core.__version__
    if not version.startswith(_SUPPORTED):
        raise RuntimeError(
            f"inverted.train.megatron_patches supports megatron-core {_SUPPORTED}, found {version}; "
            "check its CUDA assumptions before admitting it"
        )
    if getattr(torch.cuda.current_device, "_inverted_cpu", False):
        return
    # 1. current_device: every `device=torch.cuda.current_device()` becomes the CPU.
    torch.cuda.current_device = functools.wraps(torch.cuda.current_device)(_cpu_device)  # type: ignore[assignment]
    torch.cuda.current_device._inverted_cpu = True  # type: ignore[attr-defined]

    # 2. The RNG tracker: Megatron reads it through get_cuda_rng_tracker(); give it ours.
    mcore_random._CUDA_RNG_STATE_TRACKER = _cpu_rng_tracker()
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    # 3. Pipeline parallelism: the tied output layer's .cuda(), the schedule's synchronize() and its token counter.
    torch.Tensor.cuda = _on_cpu  # type: ignore[method-assign,assignment]  # patching torch is this module's job
    torch.cuda.synchronize = _no_stream
    schedules.torch = _TorchOnCPU()

    # 4. MoE: the all-to-all dispatcher's side stream (made once per class: set it so none is made).
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = False
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _dtoh_without_streams

    # 5. Uneven gathers and reduce-scatters (tensor x expert parallelism), looked up by name at each call.
    mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim = _even_for_gloo(
        mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim
    )
    # 6. Recomputation: no CUDA generator state to save or restore, looked up by name at each call.
    mcore_random._get_cuda_rng_state = _no_cuda_rng_state
    mcore_random._set_cuda_rng_state = _no_cuda_rng_state
    apply_without_te()
    logger.info(
        "megatron-core %s: CPU compatibility applied (current_device, RNG tracker, pipeline schedules, "
        "MoE dispatcher, uneven gloo collectives, recomputation)",
        version,
    )
