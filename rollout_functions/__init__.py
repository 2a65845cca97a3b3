"""Rollout functions: how leased tasks become Samples (``--rollout-function-path module:function``).

The contract (``inverted.plugins``)::

    async def generate_rollout(ctx: RolloutContext, tasks: list[Task]) -> list[Sample]

returns one Sample per task, with the task's ``group_index`` and ``index``. Built in:

- ``agent`` (default): runs the ``--env-path`` environment once per task, each episode in its own
  proxy session with an ``openai.AsyncOpenAI`` client bound to it.
- ``single_turn``: one ``/generate`` per task on the router, scored by ``--custom-rm-path``
  (slime's default rollout).
- ``subprocess_agent``: runs an existing agent program (``--agent-command``) per task, unchanged,
  with ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` pointing at its session.

They reach the proxy and the router only through their client modules, over HTTP.
"""
