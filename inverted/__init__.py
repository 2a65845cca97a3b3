"""inverted: RL post-training for language models in which the environment drives the loop.

Packages, by folder: ``buffer/`` (Data Buffer service), ``engine/`` (the embedded engine, reached
over HTTP only), ``rollout/`` (router launcher, SGLang client, chat rendering, token-recording
proxy), ``train/`` (Megatron trainer, weight sync), ``controller/`` (the main job). Shared modules:
``types`` (the ``Sample`` contract), ``errors``, ``config``, ``auth``, ``limits``, ``processes``, ...
See ``docs/architecture.md`` for the whole picture.
"""

__version__ = "0.1.0"
