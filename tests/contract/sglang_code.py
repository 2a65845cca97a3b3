"""SGLang's own serializer, bucket and process-group code, loaded from the installed sglang wheel.

The wheel is installed without its dependencies, into a folder of its own off ``sys.path`` (``make
test`` runs ``pip install --no-deps --target .venv/sglang-wire sglang==0.5.23``), so that nothing
else imports it. Its package ``__init__`` and ``sglang.srt.utils.common`` import the GPU stack
(triton, zmq, ...) at module level, so they cannot be imported here. Instead we load exactly the
code under test: ``tensor_bucket.py`` as a module under its real name, and from ``common.py`` the
source of ``MultiprocessingSerializer``, ``SafeUnpickler`` and ``init_custom_process_group``
(and the helpers they call), executed unchanged in a namespace holding their imports.
"""

from __future__ import annotations
import __future__

import ast
import importlib.machinery
import importlib.util
import io
import pickle
import sys
import types
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch

COMMON_NAMES = (
    "_safe_load_torch_storage",
    "SafeUnpickler",
    "MultiprocessingSerializer",
    "_looks_like_pickle_payload",
    "normalize_serialized_named_tensor_payload",
    "init_custom_process_group",
)
PACKAGES = ("sglang", "sglang.srt", "sglang.srt.weight_sync")


WIRE_DIR = Path(sys.prefix) / "sglang-wire"  # the Makefile's $(SGLANG_WIRE_DIR), in the venv running the tests


def sglang_root() -> Path | None:
    # finds the package without running its __init__, and past the empty stand-in ``load`` registers
    spec = importlib.machinery.PathFinder.find_spec("sglang", [str(WIRE_DIR), *sys.path])
    return Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None


def server_args_fields() -> set[str]:
    """The fields of SGLang's ``ServerArgs``, whose flags are made from them (``--max-lora-rank`` from
    ``max_lora_rank``), as its ``arg_groups/field_order.py`` lists them."""
    tree = ast.parse((sglang_root() / "srt" / "arg_groups" / "field_order.py").read_text())
    order = next(
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["POSITIONAL_FIELD_ORDER"]
    )
    return set(ast.literal_eval(order))


def load() -> types.SimpleNamespace:
    """SGLang's classes: ``FlattenedTensorBucket``, ``FlattenedTensorMetadata``, ``MultiprocessingSerializer``, ..."""
    import binascii

    import pybase64
    from packaging import version as pkg_version

    root = sglang_root()
    for name in PACKAGES:  # empty parents, so the bucket module has its real qualified name
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = []
            sys.modules[name] = package
    spec = importlib.util.spec_from_file_location(
        "sglang.srt.weight_sync.tensor_bucket", root / "srt" / "weight_sync" / "tensor_bucket.py"
    )
    bucket = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bucket
    spec.loader.exec_module(bucket)

    source = (root / "srt" / "utils" / "common.py").read_text()
    tree = ast.parse(source)
    wanted = [
        node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in COMMON_NAMES
    ]
    assert {n.name for n in wanted} == set(COMMON_NAMES), "sglang's common.py changed shape"
    namespace = {
        "__name__": "sglang.srt.utils.common",
        "io": io,
        "pickle": pickle,
        "torch": torch,
        "binascii": binascii,
        "pybase64": pybase64,
        "ForkingPickler": ForkingPickler,
        "torch_release": pkg_version.parse(torch.__version__).release,
    }
    # common.py has ``from __future__ import annotations``: compiled the same way, its annotations stay unevaluated.
    code = compile(
        ast.Module(body=wanted, type_ignores=[]),
        str(root / "srt/utils/common.py"),
        "exec",
        flags=__future__.annotations.compiler_flag,
        dont_inherit=True,
    )
    exec(code, namespace)
    return types.SimpleNamespace(
        FlattenedTensorBucket=bucket.FlattenedTensorBucket,
        FlattenedTensorMetadata=bucket.FlattenedTensorMetadata,
        **{name: namespace[name] for name in COMMON_NAMES},
    )
