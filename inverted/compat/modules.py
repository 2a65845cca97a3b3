"""slime's module paths, and what inverted puts under each: the table, and the installer.

A slime plug-in imports ``slime.utils.types``, ``slime.utils.http_utils``,
``slime.rollout.sglang_rollout``, ... ``install()`` makes each of those paths a module holding
inverted's version of its names (``compat.slime``, ``compat.slime_rollout``, ``compat.slime_loss``,
``compat.slime_cp_utils``), so a plug-in changes not one line. A module whose provider needs torch
and Megatron (the trainer's loss helpers) is named by its provider's path and imported when a
plug-in first reads from it: no other process should import them for it.

With ``INVERTED_SLIME_SOURCE`` set to a slime checkout, a module of slime's that inverted does not
provide (an in-tree plug-in such as ``slime.rollout.sglang_streaming_rollout``) imports from slime's
own file, over inverted's modules. Where slime *is* installed, its modules are left alone: the
plug-in gets slime's own classes, and the conversions work on them by field name.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any

from inverted.compat import slime, slime_rollout

# Each module's names, or the module that provides them.
MODULES: dict[str, dict[str, Any] | str] = {
    "slime": {},
    "slime.utils": {},
    "slime.utils.types": {"Sample": slime.Sample},
    "slime.utils.http_utils": {
        "post": slime.post,
        "get": slime.get,
        "__getattr__": lambda name: slime.http_utils_attr(name),
        "get_rollout_num_engines": slime_rollout.get_rollout_num_engines,
    },
    "slime.utils.misc": {
        "load_function": slime.load_function,
        "SingletonMeta": slime.SingletonMeta,
        "group_by": slime.group_by,
    },
    "slime.utils.async_utils": {"run": slime_rollout.run, "get_async_loop": slime_rollout.get_async_loop},
    "slime.utils.mask_utils": {
        "MultiTurnLossMaskGenerator": slime_rollout.MultiTurnLossMaskGenerator,
        "get_response_lengths": slime_rollout.get_response_lengths,
    },
    "slime.utils.processing_utils": {
        "load_tokenizer": slime_rollout.load_tokenizer,
        "load_processor": slime_rollout.load_processor,
        "build_processor_kwargs": slime_rollout.build_processor_kwargs,
        "encode_image_for_rollout_engine": slime_rollout.encode_image_for_rollout_engine,
    },
    "slime.rollout": {},
    "slime.rollout.base_types": {
        "RolloutFnTrainOutput": slime.RolloutFnTrainOutput,
        "RolloutFnEvalOutput": slime.RolloutFnEvalOutput,
        "call_rollout_fn": slime.call_rollout_fn,
    },
    "slime.rollout.sglang_rollout": {
        "GenerateState": slime.GenerateState,
        "generate": slime_rollout.generate,
        "generate_and_rm": slime_rollout.generate_and_rm,
        "generate_and_rm_group": slime_rollout.generate_and_rm_group,
        "_prepare_prompt_ids": slime_rollout.prepare_prompt_ids,
    },
    "slime.rollout.sft_rollout": {"generate_rollout": slime_rollout.sft_generate_rollout},
    "slime.rollout.filter_hub": {},
    "slime.rollout.filter_hub.base_types": {"DynamicFilterOutput": slime.DynamicFilterOutput},
    "slime.rollout.filter_hub.dynamic_sampling_filters": {
        "check_reward_nonzero_std": slime.check_reward_nonzero_std,
        "check_reward_nonzero_std_with_fallback": slime.check_reward_nonzero_std_with_fallback,
    },
    "slime.rollout.rm_hub": {
        "async_rm": slime_rollout.async_rm,
        "batched_async_rm": slime_rollout.batched_async_rm,
        "remote_rm": slime_rollout.remote_rm,
        "get_deepscaler_rule_based_reward": slime_rollout.get_deepscaler_rule_based_reward,
        "f1_score": slime_rollout.f1_score,
        "compute_gpqa_reward": slime_rollout.compute_gpqa_reward,
        "compute_score_dapo": slime_rollout.compute_score_dapo,
        "extract_boxed_answer": slime_rollout.extract_boxed_answer,
        "grade_answer_verl": slime_rollout.grade_answer_verl,
    },
    "slime.rollout.rm_hub.math_utils": {
        "extract_answer": slime_rollout.extract_boxed_answer,
        "grade_answer_verl": slime_rollout.grade_answer_verl,
    },
    "slime.rollout.rm_hub.math_dapo_utils": {"compute_score": slime_rollout.compute_score_dapo},
    "slime.rollout.rm_hub.deepscaler": {
        "get_deepscaler_rule_based_reward": slime_rollout.get_deepscaler_rule_based_reward
    },
    "slime.rollout.rm_hub.f1": {"f1_score": slime_rollout.f1_score, "normalize_answer": slime_rollout.normalize},
    "slime.rollout.rm_hub.gpqa": {"compute_gpqa_reward": slime_rollout.compute_gpqa_reward},
    "slime.observability": {},
    "slime.observability.trace_utils": {
        "trace_span": slime_rollout.trace_span,
        "trace_function": slime_rollout.trace_function,
        "trace_event": slime_rollout.trace_event,
        "build_sglang_meta_trace_attrs": slime_rollout.build_sglang_meta_trace_attrs,
    },
    "slime.backends": {},
    "slime.backends.megatron_utils": {},
    "slime.backends.megatron_utils.loss": "inverted.compat.slime_loss",
    "slime.backends.megatron_utils.cp_utils": "inverted.compat.slime_cp_utils",
}


def slime_installed() -> bool:
    """Whether the real slime is importable (a checkout named by ``INVERTED_SLIME_SOURCE`` is not: its
    files serve only the modules inverted does not provide)."""
    module = sys.modules.get("slime")
    if module is not None:
        return not getattr(module, "__inverted__", False)
    spec = importlib.util.find_spec("slime")
    source = os.environ.get("INVERTED_SLIME_SOURCE")
    if spec is not None and source and spec.origin:
        return not Path(spec.origin).resolve().is_relative_to(Path(source).resolve())
    return spec is not None


def _provided(provider: str, attr: str) -> Any:
    """A stand-in module's attribute, read from the module that provides it (its PEP 562 ``__getattr__``)."""
    return getattr(importlib.import_module(provider), attr)


def install() -> bool:
    """Make slime's module paths import from here, unless the real slime is installed; True if they do."""
    if slime_installed():
        return False
    source = os.environ.get("INVERTED_SLIME_SOURCE")
    for name, names in sorted(MODULES.items()):  # parents first
        if name in sys.modules:
            continue
        module = types.ModuleType(name, f"slime's {name} as provided by inverted.compat")
        setattr(module, "__inverted__", True)  # what tells inverted's stand-ins from slime's own modules
        # a package, so its submodules import; with INVERTED_SLIME_SOURCE (a slime checkout), the
        # modules inverted does not provide (slime's in-tree plug-ins) import from slime's own files
        own = Path(source, *name.split(".")) if source else None
        module.__path__ = [str(own)] if own is not None and own.is_dir() else []
        if isinstance(names, str):
            setattr(module, "__getattr__", functools.partial(_provided, names))
        else:
            module.__dict__.update(names)
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    return True
