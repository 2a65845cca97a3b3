"""Other frameworks' plug-in APIs on inverted, so their users bring their code over unchanged.

slime: ``slime`` (its ``Sample``, ``args``, router helpers and the module paths they live under),
``slime_rollout`` (its default generate and reward path, rule-based reward models, loss masks, SFT
rollout), ``slime_flags`` (every flag of its ``train.py`` and what each does here).
"""
