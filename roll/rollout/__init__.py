"""The rollout layer: each sample's lifecycle from request to reward, routing over rollout workers,
dynamic sampling and asynchronous generation (``RolloutScheduler``)."""

from roll.rollout.backend import BatchBackend, RayBackend, RolloutBackend
from roll.rollout.lifecycle import Sample, SampleState
from roll.rollout.load_balancer import LoadBalancer
from roll.rollout.router import RolloutRouter
from roll.rollout.scheduler import RolloutScheduler, SchedulerSpec

__all__ = [
    "BatchBackend",
    "LoadBalancer",
    "RayBackend",
    "RolloutBackend",
    "RolloutRouter",
    "RolloutScheduler",
    "Sample",
    "SampleState",
    "SchedulerSpec",
]
