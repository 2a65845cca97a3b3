"""inverted: RL post-training for language models in which the environment drives the loop.

Packages, by folder: ``buffer/`` (Data Buffer service), ``rollout/`` (engines, router launcher,
SGLang client, token-recording proxy), ``train/`` (Megatron trainer, weight sync). Shared modules:
``types`` (the ``Sample`` contract), ``errors``, ``config``. See DESIGN.md for the whole picture.
"""

__version__ = "0.1.0"
