"""How the embedded engine multiplies activations by its weight matrices: oneDNN on a CPU.

Every projection of a forward pass is ``x @ W.T`` with ``W`` stored ``[out, in]`` as Hugging Face
writes it. On a CPU, torch sends that to MKL's GEMM, which on this project's VMs runs at a third of
what the core can do (``bench/roofline.py``: 35-49 GFLOP/s at 32 rows on SmolLM2's shapes, against
109 for oneDNN). oneDNN is faster still when the weight is reordered once into its blocked layout
(Inductor's frozen-weight path does the same), so a matrix that is only ever multiplied is *held*
packed: ``pack`` replaces it, ``unpack`` gives back the ``[out, in]`` tensor for a weight update or
``/get_weights_by_name``. Packing keeps no copy beside it, so it costs no memory. A matrix that is
also read row by row (a tied embedding, whose rows are looked up) stays as stored and still goes
through oneDNN. On a GPU, or a torch without oneDNN, nothing is packed and ``linear`` is a matmul.

One row is the exception. A decode step of one request (c=1, or a batch's last straggler) multiplies a
single row by every matrix, so it only streams the weights from memory, and there the packed layout
can lose: on an Intel Xeon (AMX) MKL's GEMV on the stored matrix read 24-27 GB/s against oneDNN's 18-20
(a one-row step 1.2x faster). MKL runs a GEMV on one thread, though (15 GB/s on an AMD EPYC at one thread
or two), so the stored matrix is multiplied as ``threads`` blocks of its output rows in one batched
product (``split_rows``), each thread streaming its own: 29-31 GB/s on that EPYC, its read bandwidth,
against oneDNN's 22-23. So a model may also keep each packed matrix as stored (``keep_stored``), at the
cost of its memory again, and ``linear`` takes that copy for products of up to ``Stored.rows`` rows.
``stored_rows`` measures, once at load, whether and up to how many rows it pays on this machine. Only
float32 weights are kept so (activations are float32 on a CPU).

The products agree with ``torch.matmul`` to fp32 rounding (summation order only); the engine's
log-probs are checked against ``transformers`` by ``tests/engine/test_numerics.py``.
"""

from __future__ import annotations

import time
from typing import NamedTuple

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


class Stored(NamedTuple):
    """A packed matrix's copy as stored (``[out, in]``), multiplied instead for products of up to ``rows`` rows."""

    matrix: torch.Tensor
    rows: int


def keep_stored(packed: torch.Tensor, matrix: torch.Tensor, rows: int) -> None:
    """Hold ``matrix`` (the stored form of ``packed``) beside it, for products of up to ``rows`` rows
    (an attribute of the tensor, as Megatron marks its parameters; 0 rows holds none)."""
    packed.stored = Stored(matrix, rows) if rows else None  # type: ignore[attr-defined]


def stored_copy(weight: torch.Tensor) -> Stored | None:
    return getattr(weight, "stored", None)


def unpack(weight: torch.Tensor) -> torch.Tensor:
    """The ``[out, in]`` tensor of a packed weight (a copy), or ``weight`` itself when it is not packed."""
    if not weight.is_mkldnn:
        return weight
    stored = stored_copy(weight)
    return stored.matrix.clone() if stored is not None else weight.to_dense()


# A stored copy is kept only when it streams a pass over the model's matrices this much faster.
STORED_MIN_GAIN = 1.1
# Below this many bytes a pass over the matrices takes microseconds, too few to time against the noise
# (and a step's GEMMs are not its cost): no copies are kept, and a small model behaves the same everywhere.
STORED_MIN_BYTES = 64 * 1024**2
STORED_ROWS_TRIED = (1, 2, 4)  # at 8 rows oneDNN's packed GEMM is far ahead everywhere we measured


def stored_rows(pairs: list[tuple[torch.Tensor, torch.Tensor]], repeats: int = 2) -> int:
    """Up to how many rows a pass over ``(packed, stored)`` matrices is ``STORED_MIN_GAIN`` faster from
    the stored ones (0: at none), timed here at 1, 2 and 4 rows, the best of ``repeats`` passes each
    (under ``STORED_MIN_BYTES`` in all: 0, untimed)."""
    if sum(stored.numel() * stored.element_size() for _, stored in pairs) < STORED_MIN_BYTES:
        return 0

    def seconds(rows: int, from_stored: bool) -> float:
        inputs = {m.shape[1]: torch.randn(rows, m.shape[1], dtype=m.dtype) for _, m in pairs}
        best = float("inf")
        for _ in range(repeats + 1):  # the first warms the kernels up
            started = time.perf_counter()
            for packed, stored in pairs:
                if from_stored:
                    split_rows(inputs[stored.shape[1]], stored)
                else:
                    linear(inputs[stored.shape[1]], packed)
            best = min(best, time.perf_counter() - started)
        return best

    rows = 0
    for tried in STORED_ROWS_TRIED:
        if seconds(tried, from_stored=False) <= STORED_MIN_GAIN * seconds(tried, from_stored=True):
            break
        rows = tried
    return rows


def _mkl(x: torch.Tensor, weight: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
    """torch's own ``add + x @ weight.T`` (MKL on a CPU), both in one dtype."""
    return x @ weight.t() if add is None else torch.addmm(add, x, weight.t())


def split_rows(x: torch.Tensor, weight: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
    """``add + x @ weight.T`` for a few rows of ``x``, with ``weight``'s output rows split in one block per
    thread and the blocks multiplied as one batch: each thread streams its block (MKL's GEMV alone would
    stream the whole matrix on one). A split that does not divide the output falls back to ``_mkl``."""
    parts, rows, out_features = torch.get_num_threads(), x.shape[0], weight.shape[0]
    if parts < 2 or out_features % parts:
        return _mkl(x, weight, add)
    blocks = torch.bmm(weight.view(parts, out_features // parts, -1), x.t().expand(parts, -1, -1))
    out = blocks.permute(2, 0, 1).reshape(rows, out_features).contiguous()  # a view for one row, else a copy
    return out if add is None else out.add_(add)


def linear(x: torch.Tensor, weight: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
    """``add + x @ weight.T``, in ``x``'s dtype, computed in the weight's dtype.

    ``add`` is a bias ``[out]`` or a residual ``[rows, out]``; oneDNN adds either inside the GEMM.
    A packed matrix with a stored copy multiplies few rows through the copy (``split_rows``).
    """
    if weight.is_mkldnn and (stored := stored_copy(weight)) is not None and x.shape[0] <= stored.rows:
        return split_rows(x, stored.matrix, add)
    if not (weight.is_mkldnn or packs(weight.device, weight.dtype)):
        if x.dtype == weight.dtype:
            return _mkl(x, weight, add)
        out = (x.to(weight.dtype) @ weight.t()).to(x.dtype)
        return out if add is None else out.add_(add)
    if x.dtype != weight.dtype:
        out = torch.ops.mkldnn._linear_pointwise(x.to(weight.dtype), weight, None, "none", [], "").to(x.dtype)
        return out if add is None else out.add_(add)
    if add is None or add.dim() == 1:
        return torch.ops.mkldnn._linear_pointwise(x, weight, add, "none", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, add, weight, None, "add")
