"""The main job, ``inverted train``: start every part, run the loop, supervise, always clean up.

Read it in this order:

- ``loop``: the training loop, written once: take a batch, train or skip, sync, evaluate, save, log;
- ``sources``: where a step's batch comes from: rolled out by the step (sync) or by a producer that
  never stops (``--async-mode``, with AReaL's staleness rule, ``Admission``);
- ``ledger``: which batch each step was served, so a resumed job and a restarted trainer replay it;
- ``trainer``: the one door into the trainer group (typed calls behind one lock, the step counter,
  its restart after a rank dies);
- ``job``: the running parts and the weights the servers hold; ``supervisor``: their healing;
- ``rollouts``: calling the rollout function; ``evaluation``; ``step_metrics``: a step's row;
- ``config``: ``JobConfig`` (one section per part) and ``LoopConfig``;
- ``main``: ``run``, the entry point: check everything, start the job, run the loop.
"""
