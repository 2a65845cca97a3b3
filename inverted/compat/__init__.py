"""Other frameworks' plug-in APIs on inverted, so their users bring their code over unchanged.

An adapter at the edge: no core module imports this package. The entry points call ``register()``
before anything loads a plug-in (``inverted.cli``, which every service runs under, and the set-up it
hands to the trainer's Ray workers and processes), and the core loader (``inverted.plugins``)
then finds slime's forms in its registry.

slime:
- ``slime``: its ``Sample`` and the conversions to and from ours, its ``args``, its router helpers;
- ``slime_rollout``: its default generate and reward path, rule-based reward models, loss masks, SFT rollout;
- ``slime_loss``, ``slime_cp_utils``: the trainer-side helpers its loss plug-ins import;
- ``modules``: slime's module paths, each with what inverted puts under it, and their installer;
- ``slime_forms``: each plug-in point's slime signature and the adapter to inverted's hook;
- ``slime_dump``: its ``.pt`` rollout dump;
- ``slime_flags``: every flag of its ``train.py`` and what each does here; ``slime_config``: what
  ``inverted train`` does with the ones given.
"""

from __future__ import annotations


def register() -> None:
    """Make slime's plug-ins load unchanged in this process: its module paths (unless slime itself
    is installed), its form of every plug-in point, its ``.pt`` rollout dump. Idempotent."""
    from inverted.compat import modules, slime_dump, slime_forms
    from inverted.plugins import DUMP_FORMATS, DumpFormat

    modules.install()
    slime_forms.register()
    DUMP_FORMATS[".pt"] = DumpFormat(read=slime_dump.read, write=slime_dump.write)
