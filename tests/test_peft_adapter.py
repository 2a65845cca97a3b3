"""What a PEFT adapter may target, read as PEFT reads ``target_modules`` (``inverted/peft_adapter.py``)."""

from __future__ import annotations

import pytest

from inverted.errors import ModelError
from inverted.peft_adapter import MODULES, parse_name, target_modules, tensor_name


def test_target_modules_read_as_peft_reads_them():
    projections = tuple(MODULES)
    assert target_modules("all-linear") == target_modules(["all"]) == projections  # PEFT: not the output layer
    assert target_modules(["all", "lm_head"]) == (*projections, "lm_head")
    assert target_modules(["model.layers.0.self_attn.q_proj", "lm_head"]) == ("q_proj", "lm_head")
    # one string: a regex over full module names (the output layer's is lm_head, at the top)
    assert target_modules(r".*\.v_proj|lm_head") == ("v_proj", "lm_head")
    with pytest.raises(ModelError, match="lm_head"):  # the choices are named
        target_modules(["embed_tokens"])


def test_the_output_layer_s_tensors_name_no_layer():
    for which in "AB":
        name = tensor_name(None, "lm_head", which)
        assert name == f"base_model.model.lm_head.lora_{which}.weight"
        assert parse_name(name) == (None, "lm_head", which)
    assert parse_name(tensor_name(3, "down_proj", "B")) == (3, "down_proj", "B")
    with pytest.raises(ModelError, match="output layer"):
        parse_name("base_model.model.model.embed_tokens.lora_embedding_A")
