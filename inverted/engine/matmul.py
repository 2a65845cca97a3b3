"""How the embedded engine multiplies activations by its weight matrices: oneDNN on a CPU.

Every projection of a forward pass is ``x @ W.T`` with ``W`` stored ``[out, in]`` as Hugging Face
writes it. On a CPU, torch sends that to MKL's GEMM, which on this project's VMs runs at a third of
what the core can do (``bench/roofline.py``: 35-49 GFLOP/s at 32 rows on SmolLM2's shapes, against
109 for oneDNN). oneDNN is faster still when the weight is reordered once into its blocked layout
(Inductor's frozen-weight path does the same), so a matrix that is only ever multiplied is *held*
packed: ``pack`` replaces it, ``unpack`` gives back the ``[out, in]`` tensor for a weight update or
``/get_weights_by_name``. No copy is kept beside it, so packing costs no memory. A matrix that is
also read row by row (a tied embedding, whose rows are looked up) stays as stored and still goes
through oneDNN. On a GPU, or a torch without oneDNN, nothing is packed and ``linear`` is a matmul.

The products agree with ``torch.matmul`` to fp32 rounding (summation order only); the engine's
log-probs are checked against ``transformers`` by ``tests/engine/test_numerics.py``.
"""

from __future__ import annotations

import torch


def packs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights of ``dtype`` on ``device`` are held packed (a CPU with oneDNN; fp32 or bf16)."""
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and dtype in (torch.float32, torch.bfloat16)


# The batch size oneDNN lays a packed weight out for. Measured on SmolLM2's shapes (2 threads, AVX-512):
# 32 was as fast as or faster than no hint at 1, 8 and 32 rows (a decode step's range), by up to 25 %.
PACKED_FOR_ROWS = 32


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` reordered into oneDNN's layout for ``linear`` (a new, opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACKED_FOR_ROWS)


def unpack(weight: torch.Tensor) -> torch.Tensor:
    """The ``[out, in]`` tensor of a packed weight (a copy), or ``weight`` itself when it is not packed."""
    return weight.to_dense() if weight.is_mkldnn else weight


def linear(x: torch.Tensor, weight: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
    """``add + x @ weight.T``, in ``x``'s dtype, computed in the weight's dtype.

    ``add`` is a bias ``[out]`` or a residual ``[rows, out]``; oneDNN adds either inside the GEMM.
    """
    if not (weight.is_mkldnn or packs(weight.device, weight.dtype)):
        if x.dtype == weight.dtype:
            return x @ weight.t() if add is None else torch.addmm(add, x, weight.t())
        out = (x.to(weight.dtype) @ weight.t()).to(x.dtype)
        return out if add is None else out.add_(add)
    if x.dtype != weight.dtype:
        out = torch.ops.mkldnn._linear_pointwise(x.to(weight.dtype), weight, None, "none", [], "").to(x.dtype)
        return out if add is None else out.add_(add)
    if add is None or add.dim() == 1:
        return torch.ops.mkldnn._linear_pointwise(x, weight, add, "none", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, add, weight, None, "add")
