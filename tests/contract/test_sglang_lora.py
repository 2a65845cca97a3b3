"""Our PEFT adapters as real SGLang (0.5.23, ``make sglang``) reads them: its own ``LoRAAdapter``
takes an adapter we wrote (the names and shapes the trainer exports and syncs) as
``/load_lora_adapter_from_tensors`` hands it over, and puts each tensor where its LoRA layers take
it. SGLang's LoRA layers need CUDA, so no server runs here: the code is SGLang's, run in its own
interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from inverted.hf_checkpoint import ModelSpec
from inverted.peft_adapter import HEAD, LoRAConfig, head_shape, module_shapes, tensor_name, write_adapter
from inverted.rollout.servers import SGLANG_LAUNCH
from tests.conftest import SGLANG_PYTHON

pytestmark = pytest.mark.slow

# Run by SGLang's interpreter: load the adapter with SGLang's classes, report where each tensor went.
READ = """
import json, sys
from safetensors.torch import load_file
from transformers import AutoConfig
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.lora.lora import LoRAAdapter
from sglang.srt.lora.lora_config import LoRAConfig

base, path = sys.argv[1:]
adapter = LoRAAdapter("policy", LoRAConfig(path), AutoConfig.from_pretrained(base), LoadConfig(), None)
adapter.initialize_weights_from_tensors(load_file(path + "/adapter_model.safetensors"))
print(json.dumps({
    "scaling": adapter.scaling,
    "embedding": {name: list(t.shape) for name, t in adapter.embedding_layers.items()},
    "layers": [{name: list(t.shape) for name, t in layer.weights.items()} for layer in adapter.layers],
}))
"""


def test_sglang_loads_our_adapter_with_its_output_layer(tiny_model, tmp_path):
    if not SGLANG_PYTHON.exists():
        pytest.skip(f"real SGLang is not installed ({SGLANG_PYTHON}): make sglang")
    base = tiny_model("qwen2")
    spec = ModelSpec.from_checkpoint(base)
    config = LoRAConfig(rank=4, alpha=8.0, modules=("q_proj", "k_proj", "v_proj", "down_proj", HEAD))
    shapes = {**module_shapes(spec), HEAD: head_shape(spec)}
    tensors = {
        tensor_name(layer, module, which): torch.randn(
            (4, shapes[module][1]) if which == "A" else (shapes[module][0], 4)
        )
        for layer in [*range(spec.num_layers), None]
        for module in config.modules
        if (layer is None) == (module == HEAD)
        for which in "AB"
    }
    path = write_adapter(tmp_path / "adapter", config, tensors, str(base))
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": str(SGLANG_LAUNCH.parent)}
    done = subprocess.run(
        [str(SGLANG_PYTHON), "-c", READ, str(base), str(path)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    read = json.loads(done.stdout.strip().splitlines()[-1])
    assert read["scaling"] == config.scaling
    vocab, hidden = head_shape(spec)
    assert read["embedding"] == {  # the output layer's adapter, where ParallelLMHeadWithLoRA takes it
        tensor_name(None, HEAD, "A"): [4, hidden],
        tensor_name(None, HEAD, "B"): [vocab, 4],
    }
    q, kv = shapes["q_proj"][0], shapes["k_proj"][0]
    for layer, weights in enumerate(read["layers"]):  # q/k/v stacked into SGLang's qkv_proj, down_proj as is
        prefix = f"base_model.model.model.layers.{layer}"
        assert weights == {
            f"{prefix}.self_attn.qkv_proj.lora_A.weight": [3 * 4, hidden],
            f"{prefix}.self_attn.qkv_proj.lora_B.weight": [q + 2 * kv, 4],
            f"{prefix}.mlp.down_proj.lora_A.weight": [4, shapes["down_proj"][1]],
            f"{prefix}.mlp.down_proj.lora_B.weight": [hidden, 4],
        }, weights
