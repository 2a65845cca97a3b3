"""Example environments: plain async functions of ``(task, client) -> reward`` (``--env-path``).

An environment does not know it is trained. It reads the task (``prompt``, ``label``,
``metadata``, ``tools``), talks to the policy through the ``openai.AsyncOpenAI`` client it is
given, and returns a reward: a float, or a dict of named floats. Raising, or taking longer than
``--rollout-episode-timeout``, makes the episode a ``failed`` Sample, which is never trained on.

- ``letters``: a single-turn task the tiny random model learns in minutes (``make demo``).
- ``calculator``: multi-turn tool use with OpenAI ``tools`` (a calculator), with feedback turns.
- ``countdown``: the countdown arithmetic puzzle with an exact verifier, for real models.
- ``long_tail``: the letters task behind a slow simulated tool, one prompt in ten twenty times slower
  (the asynchronous loop's benchmark).
- ``reasoning_gym``: any reasoning-gym task, graded by the library (the main job's).
- ``coding``: mini-swe-agent fixes a tiny repository, its commands in ``sandbox`` (bubblewrap: no
  network, the system read-only but the task's copy, per-command limits).
- ``local_search``: a BM25 search over a local corpus, for hosted ``web_search`` tools
  (``--proxy-hosted-tools``).
- ``verifiers`` and ``openenv``: the environments of those libraries, run as they are;
  ``guess_number`` is an OpenEnv environment with its driver.

Each module also writes its own prompt dataset: ``python -m envs.letters --out FILE.jsonl``.
"""
