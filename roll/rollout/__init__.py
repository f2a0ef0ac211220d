"""The rollout layer: scheduling samples, episodes and agent runs through the rollout workers.

- ``group_scheduler``: the core every flow stands on (groups in draw order, staleness, batches, the thread
  that generates ahead); ``scheduler.RolloutScheduler`` (RLVR samples, dynamic sampling),
  ``episodes.EpisodeScheduler`` (multi-turn episodes) and ``agent_scheduler.AgentScheduler`` (runs of a
  user's agent program) are its three flows.
- ``lifecycle``: each sample's states from request to reward; ``router``, ``load_balancer``, ``backend``:
  routing over the rollout and reward workers behind one I/O seam.
- ``sessions``: an agent's calls recorded as token ids, which the endpoint (``roll.serving``) fills.

Nothing is imported here, so that a light module such as ``lifecycle`` loads without the scheduler's
torch and Ray.
"""
