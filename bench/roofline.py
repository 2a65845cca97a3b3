"""This machine's roofline for serving a model: its memory bandwidth and its best GEMM rate. Prints JSON.

Decoding one request reads every weight once per token, so at concurrency 1 a model of ``W`` bytes
cannot run faster than ``read bandwidth / W`` tokens/s, whatever the engine. With C requests in
flight a decode step is C rows through the same weights, and at 32 rows on a CPU the multiply-adds
dominate: no engine passes ``best GEMM rate / (2 x parameters)`` tokens/s (attention aside, which
only lowers it). Both bounds are measured here, not taken from a data sheet:

- **bandwidth**: a read-only pass (``sum``) and a STREAM-like copy (read + write, counted twice)
  over buffers far past the last-level cache, best of several passes; the read rate is decode's
  bound.
- **GEMM**: the fastest way this torch build multiplies ``[rows x in]`` activations by the model's
  own weight matrices (all of them, streamed from memory) in the dtype: ``torch.matmul`` on weights
  as stored (``[out, in]``, transposed view; MKL), on pre-transposed ``[in, out]`` copies, and on
  oneDNN-packed weights (``mkldnn._reorder_linear_weight`` + ``mkldnn._linear_pointwise``, the path
  Inductor freezes to), and on weights as stored split in one block of output rows per thread, the
  blocks multiplied as one batch (``inverted.engine.matmul.split_rows``: MKL's GEMV alone streams on
  one thread); each method's rate is reported, and the best is the bound.

``bench/engine_throughput.py`` reports each engine against these bounds; run alone:

    python bench/roofline.py --model models/smollm2-135m --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import torch

from inverted.engine.matmul import split_rows

BUFFER_BYTES = 1 << 29  # 512 MiB: far past any CPU's last-level cache


def _best_seconds(run: Callable[[], object], repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def bandwidth_gbs(repeats: int = 8) -> dict[str, float]:
    """Best read-only and copy rates over ``BUFFER_BYTES`` buffers, in GB/s."""
    src = torch.ones(BUFFER_BYTES // 4)
    dst = torch.empty_like(src)
    read = _best_seconds(src.sum, repeats)
    copy = _best_seconds(lambda: dst.copy_(src), repeats)
    return {"read_gbs": round(BUFFER_BYTES / read / 1e9, 2), "copy_gbs": round(2 * BUFFER_BYTES / copy / 1e9, 2)}


def _methods(weight: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Ways to compute ``x @ weight.T``, each with what it prepares once (as an engine would at load)."""
    transposed = weight.t().contiguous()
    methods = {
        "matmul": lambda x: x @ weight.t(),
        "pretransposed": lambda x: x @ transposed,
        "split_rows": lambda x: split_rows(x, weight),
    }
    if weight.device.type == "cpu" and torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        methods["onednn_packed"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return methods


def gemm_gflops(shapes: list[tuple[int, int]], rows: int, dtype: torch.dtype, repeats: int = 5) -> dict[str, float]:
    """Each method's rate, in GFLOP/s, over one pass of every ``(out, in)`` weight shape at ``rows`` rows.
    Every method's product is checked against ``matmul``'s first: a fast wrong path is no bound."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, inp, generator=generator).to(dtype) / inp**0.5 for out, inp in shapes]
    inputs = {inp: torch.randn(rows, inp, generator=generator).to(dtype) for _, inp in shapes}
    prepared = [_methods(w) for w in weights]
    flops = sum(2 * rows * out * inp for out, inp in shapes)
    rates = {}
    for name in prepared[0]:
        for (_, inp), methods in zip(shapes, prepared):
            got, want = methods[name](inputs[inp]).float(), methods["matmul"](inputs[inp]).float()
            if not torch.allclose(got, want, rtol=2e-2 if dtype != torch.float32 else 1e-4, atol=1e-3):
                raise AssertionError(f"{name} disagrees with matmul on {tuple(want.shape)}")
        seconds = _best_seconds(lambda: [m[name](inputs[inp]) for (_, inp), m in zip(shapes, prepared)], repeats)
        rates[name] = round(flops / seconds / 1e9, 2)
    return rates


def model_shapes(model_dir: str) -> tuple[list[tuple[int, int]], int]:
    """The shape of every matrix a token multiplies (each layer's fused q/k/v, o, fused gate/up and
    down, then the lm head), as the embedded engine holds them, and how many weights that is (the
    embedding is a lookup of one row). Every layer's matrices are distinct tensors in the GEMM timing,
    so a pass streams them from memory as decoding does: one layer's would sit in the caches and
    overstate the one-row rate (by 1.8x on an Intel Xeon here). Dense models."""
    from inverted.hf_checkpoint import ModelSpec

    spec = ModelSpec.from_checkpoint(model_dir)
    if spec.is_moe:
        raise SystemExit("bench/roofline.py bounds dense models: a MoE token reads only its experts")
    hidden, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    layer = [(q + 2 * kv, hidden), (hidden, q), (2 * spec.intermediate_size, hidden), (hidden, spec.intermediate_size)]
    head = (spec.vocab_size, hidden)
    shapes = layer * spec.num_layers + [head]
    return shapes, sum(o * i for o, i in shapes)


def measure(model_dir: str, dtype: torch.dtype, rows: tuple[int, ...] = (1, 32)) -> dict:
    """The machine's bounds, and the model's: tokens/s at one request (bandwidth) and at each ``rows``."""
    shapes, multiplied = model_shapes(model_dir)
    read_per_token = multiplied * torch.empty(0, dtype=dtype).element_size()
    bandwidth = bandwidth_gbs()
    gemm = {n: gemm_gflops(shapes, n, dtype) for n in rows}
    return {
        "threads": torch.get_num_threads(),
        "dtype": str(dtype).removeprefix("torch."),
        "cpu": _cpu_name(),
        "bandwidth": bandwidth,
        "gemm_gflops": gemm,
        "weights_per_token": multiplied,
        "bytes_per_token": read_per_token,
        "bandwidth_bound_tokens_per_s": round(bandwidth["read_gbs"] * 1e9 / read_per_token, 1),
        "compute_bound_tokens_per_s": {n: round(max(r.values()) * 1e9 / (2 * multiplied), 1) for n, r in gemm.items()},
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a checkpoint directory (its shapes and size)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(json.dumps(measure(args.model, getattr(torch, args.dtype), tuple(args.rows)), indent=2))


if __name__ == "__main__":
    main()
