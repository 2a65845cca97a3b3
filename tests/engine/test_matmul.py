"""The engine's weight matrices as oneDNN holds them on a CPU: the same products, the same weights.

``engine.matmul`` packs the matrices a forward only multiplies, and may keep them also as stored for
steps of few rows (split among the threads); these tests hold both paths to ``torch.matmul``, each to
the rows it serves, and hold the model's loads and reads (``Slot``) to the tensors they were given,
whatever part of a fused matrix a load names, in both forms. The engine's log-probs against ``transformers`` are
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


@pytest.mark.parametrize("add", ["none", "bias", "residual"])
def test_a_stored_copy_multiplies_products_of_up_to_its_rows_and_the_packed_matrix_the_rest(add):
    generator = torch.Generator().manual_seed(1)
    weight, other = (torch.randn(64, 32, generator=generator) for _ in range(2))
    packed = matmul.pack(weight)
    # A copy that differs from the packed matrix (no model holds one so) shows which of them multiplied.
    matmul.keep_stored(packed, other, rows=2)
    for rows, used in ((1, other), (2, other), (3, weight), (8, weight)):
        x = torch.randn(rows, 32, generator=generator)
        extra = {"none": None, "bias": torch.randn(64), "residual": torch.randn(rows, 64)}[add]
        want = x @ used.t() + (0 if extra is None else extra)
        torch.testing.assert_close(matmul.linear(x, packed, extra), want, rtol=1e-5, atol=1e-5)
    copy = matmul.unpack(packed)  # what a load writes into: a copy, never the matrix being multiplied
    assert torch.equal(copy, other) and copy.data_ptr() != other.data_ptr()
    matmul.keep_stored(packed, other, rows=0)
    assert matmul.stored_copy(packed) is None and torch.equal(matmul.unpack(packed), weight)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("add", ["none", "bias", "residual"])
def test_a_stored_copy_split_among_the_threads_multiplies_as_torch_matmul(threads, add):
    """``split_rows`` (a stored copy's product: one block of output rows per thread, in one batch), at 1 to 4
    rows, for outputs the threads divide (96) and do not (64 at 3 threads: one product, unsplit)."""
    generator = torch.Generator().manual_seed(3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for out_features in (96, 64):
            weight = torch.randn(out_features, 40, generator=generator)
            for rows in (1, 2, 3, 4):
                x = torch.randn(rows, 40, generator=generator)
                extra = {
                    "none": None,
                    "bias": torch.randn(out_features, generator=generator),
                    "residual": torch.randn(rows, out_features, generator=generator),
                }[add]
                want = x @ weight.t() + (0 if extra is None else extra)
                got = matmul.split_rows(x, weight, None if extra is None else extra.clone())
                assert got.shape == (rows, out_features) and got.is_contiguous()
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)


def test_a_load_writes_the_stored_copies_and_one_row_steps_match_the_packed_path(tiny_model):
    """With stored copies (forced here: a tiny model is under ``matmul.STORED_MIN_BYTES``, where the measurement
    at load keeps none), a weight update reaches both forms of a matrix, and a one-row step through the
    copies computes what the packed matrices compute."""
    from inverted.engine.model import KVCache

    path = tiny_model("qwen2")
    both, packed_only = load_model(path, torch.float32, CPU, stored_rows=2), load_model(path, torch.float32, CPU)
    assert both.stored_rows == 2 and packed_only.stored_rows == 0
    generator = torch.Generator().manual_seed(2)
    given = checkpoint_tensors(path)
    update = {
        name: torch.randn(tensor.shape, generator=generator) * tensor.std()
        for name, tensor in given.items()
        if name.startswith("model.layers.1.") and name.endswith(("q_proj.weight", "down_proj.weight"))
    }
    for model in (both, packed_only):
        model.load_weights(update, complete=False)
    layer = both.layers[1]
    for attr in ("qkv", "o", "gate_up", "down"):
        stored = matmul.stored_copy(getattr(layer, attr))
        assert stored is not None and torch.equal(stored.matrix, getattr(layer, attr).to_dense())
    for name, tensor in update.items():
        assert torch.equal(both.hf_slots[name].view(), tensor)

    hidden = []
    for model in (both, packed_only):
        cache = KVCache(model.spec, 2, 64, torch.float32, CPU)
        model.prefill(cache, [0], [list(range(3, 20))], [0])
        hidden.append(model.logits(model.decode(cache, [21], [17])))
    torch.testing.assert_close(hidden[0], hidden[1], rtol=1e-5, atol=1e-5)


def test_a_server_started_with_stored_copies_reports_them_and_answers_as_one_without(procs, tiny_model):
    """``--stored-copy-rows`` reaches the model (``/server_info`` reports what was resolved: a tiny model
    keeps none by default), and a request decoded one row at a time through the copies gets the same
    tokens and log-probs as without them."""
    import httpx

    model = tiny_model("qwen2")
    flags = ([], ["--stored-copy-rows", "2"])
    urls = [procs.engine(model, *extra, name=f"engine{i}").url for i, extra in enumerate(flags)]
    assert [httpx.get(url + "/server_info").json()["stored_copy_rows"] for url in urls] == [0, 2]
    body = {
        "input_ids": list(range(30, 50)),
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
    }
    plain, stored = (httpx.post(url + "/generate", json=body, timeout=60).json() for url in urls)
    assert stored["output_ids"] == plain["output_ids"]
    got, want = (
        torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]) for out in (stored, plain)
    )
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
