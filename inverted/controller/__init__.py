"""The main job, ``inverted train``: start every part, run the loop, supervise, always clean up.

Read it in this order:

- ``loop``: the training loop, written once: take a batch, train or skip, sync, log the step's
  row, evaluate and save when due. A step calls into two modules besides it:
- ``sources``: where a step's batch comes from: rolled out by the step (sync) or by a producer that
  never stops (``--async-mode``, with AReaL's staleness rule, ``Admission``); each batch measured and
  filtered by ``batches``;
- ``trainer``: the one door into the trainer group (typed calls behind one lock, the step counter,
  the weights the servers hold and their sync, its restart after a rank dies);
- ``ledger``: which batch each step was served, so a resumed job and a restarted trainer replay it;
- ``job``: the running parts; ``supervisor``: their healing;
- ``rollouts``: calling the rollout function; ``evaluation``: the policy on the held-out prompts;
- ``config``: ``JobConfig`` (one section per part) and ``LoopConfig``;
- ``main``: ``run``, the entry point: check everything, start the job, run the loop.
"""
