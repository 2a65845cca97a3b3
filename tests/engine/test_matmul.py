"""The engine's weight matrices as oneDNN holds them on a CPU: the same products, the same weights.

``engine.matmul`` packs the matrices a forward only multiplies; these tests hold the packed path to
``torch.matmul`` and hold the model's loads and reads (``Slot``) to the tensors they were given,
whatever part of a fused matrix a load names. The engine's log-probs against ``transformers`` are
``test_numerics.py``'s.
"""

from __future__ import annotations

import pytest
import torch

from inverted.engine import matmul
from inverted.engine.model import load_model
from inverted.hf_checkpoint import checkpoint_tensors

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not matmul.packs(CPU, torch.float32), reason="this torch has no oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("add", ["none", "bias", "residual"])
def test_a_packed_weight_multiplies_as_torch_matmul(dtype, add):
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(96, 40, generator=generator) / 40**0.5).to(dtype)
    x = torch.randn(7, 40, generator=generator)
    extra = {
        "none": None,
        "bias": torch.randn(96, generator=generator),
        "residual": torch.randn(7, 96, generator=generator),
    }[add]
    want = (x.to(dtype) @ weight.t()).float() + (0 if extra is None else extra)
    packed = matmul.pack(weight)
    assert packed.is_mkldnn and torch.equal(matmul.unpack(packed), weight)
    for held in (packed, weight):  # packed, and as stored (a tied embedding's head)
        got = matmul.linear(x, held, extra)
        assert got.dtype == x.dtype and got.shape == (7, 96)
        torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)


def test_the_model_holds_its_matrices_packed_and_a_load_writes_exactly_the_slots_it_names(tiny_model):
    path = tiny_model("qwen2")
    model = load_model(path, torch.float32, CPU)
    layer = model.layers[0]
    assert all(getattr(layer, attr).is_mkldnn for attr in ("qkv", "o", "gate_up", "down"))
    assert not model.embed.is_mkldnn  # its rows are looked up
    given = checkpoint_tensors(path)
    for name, tensor in given.items():
        assert torch.equal(model.hf_slots[name].view(), tensor.float()), name

    # A load naming one part of a fused, packed matrix leaves the other parts as they were.
    q = "model.layers.0.self_attn.q_proj.weight"
    new_q = torch.randn_like(given[q])
    model.load_weights({q: new_q}, complete=False)
    assert layer.qkv.is_mkldnn
    assert torch.equal(model.hf_slots[q].view(), new_q)
    for other in ("k_proj", "v_proj"):
        name = f"model.layers.0.self_attn.{other}.weight"
        assert torch.equal(model.hf_slots[name].view(), given[name])
