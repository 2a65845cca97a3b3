"""slime's rollout dump: what its ``--save-debug-rollout-data`` writes for a ``.pt`` path, and reads back.

``torch.save({"rollout_id": N, "samples": [Sample.to_dict()]})``, which slime's
``--load-debug-rollout-data`` and ``forge_load`` read. Registered with the loader as the ``.pt``
format (``plugins.DUMP_FORMATS``), so ``inverted train --save-debug-rollout-data X.pt`` writes it
and ``--load-debug-rollout-data X.pt`` trains from it (ours or one slime's own run wrote). It is read
with ``torch.load(weights_only=True)``, so a dump cannot run code.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from inverted.compat import slime
from inverted.errors import SampleError
from inverted.types import Sample


def read(path: Path) -> list[Sample]:
    import torch

    try:
        dump = torch.load(path, weights_only=True)
        views = [slime.Sample.from_dict(data) for data in dump["samples"]]
    except OSError as exc:
        raise SampleError(f"--load-debug-rollout-data {path}: cannot read: {exc}") from None
    except (RuntimeError, pickle.UnpicklingError, KeyError, TypeError, ValueError) as exc:
        raise SampleError(
            f"--load-debug-rollout-data {path}: not a slime rollout dump ({{'rollout_id', 'samples': [...]}}): {exc}"
        ) from None
    samples = []
    for number, view in enumerate(views):
        try:
            # a dump's Samples were trained by slime as they are: where one holds no versions, it is
            # read as sampled by the weights it starts from ("default")
            sample = slime.to_inverted(view, serving=slime.Serving("default"))
            sample.validate()
        except SampleError as exc:
            raise SampleError(f"{path}: sample {number}: {exc}") from None
        samples.append(sample)
    return samples


def write(path: Path, rollout_id: int, samples: list[Sample], flags: dict[str, Any]) -> None:
    import torch

    args = slime.SlimeArgs.of(flags) if flags else None  # the job's: slime's numbering and response text
    torch.save(
        {
            "rollout_id": rollout_id,
            "samples": [slime.from_inverted(s, cls=slime.Sample, args=args).to_dict() for s in samples],
        },
        path,
    )
