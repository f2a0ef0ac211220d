"""The rollout layer: each sample's lifecycle from request to reward (``lifecycle``), routing over rollout
workers (``router``, ``load_balancer``, ``backend``), dynamic sampling and asynchronous generation
(``scheduler.RolloutScheduler``), and multi-turn episodes (``episodes``).

Nothing is imported here, so that a light module such as ``lifecycle`` loads without the scheduler's
torch and Ray.
"""
