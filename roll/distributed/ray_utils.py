"""Start or join Ray for the single controller."""

from __future__ import annotations

import logging
import os

from roll.utils import signals


def start_ray(address: str | None, num_cpus: int | None = None, num_gpus: int | None = None) -> None:
    """Join the Ray cluster at ``address``, else start a local Ray with ``num_cpus`` and ``num_gpus``
    (None: detected). A no-op when Ray is already running in this process. A cluster that cannot be
    joined raises ConnectionError; ``roll.pipelines.common.init_ray`` names the setting it came from."""
    import ray

    if ray.is_initialized():
        return
    # Workers find `roll` through the installed package; keep Ray's own logs quiet so metrics stay readable.
    common = {"logging_level": logging.WARNING, "log_to_driver": True, "runtime_env": worker_runtime_env()}
    if address:
        ray.init(address=address, **common)
    else:
        # "local": a Ray of this run's own. Without an address ray.init() would join whatever cluster
        # `ray start` (or another program) last recorded on this machine, and die with it.
        ray.init(
            address="local",
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            include_dashboard=False,
            _system_config=local_system_config(),
            **common,
        )
    # Ray's core worker has just replaced the SIGTERM handler with one that dumps a stack and aborts.
    signals.reinstall()


# Ray starts its workers at niceness 15, so any other busy process on the machine (a compile, another
# job) takes the cores from the whole run and starves its workers (docs/performance.md). The workers are
# the run's work: they run at the driver's priority. (A cluster that is joined keeps its own setting.)
def local_system_config() -> dict:
    """The system config of a Ray this process starts: workers at niceness 0. A new dict on every call,
    since ray.init adds its own keys to the one it is given."""
    return {"worker_niceness": 0}


# How long an idle OpenMP thread of a worker spins before it sleeps (libgomp's GOMP_SPINCOUNT, in rounds
# of a few nanoseconds). The stages of a step run one after another in different worker processes:
# with libgomp's default (300,000 rounds) the actor's threads are still spinning on the cores when the
# rollout worker starts generating, and slow it down. With no spin at all (OMP_WAIT_POLICY=PASSIVE),
# every parallel region wakes its threads through the kernel, which slows the train step instead. This
# short spin bridges the gaps inside a forward pass but not those between stages. docs/performance.md
# has the measurements.
WORKER_SPIN_COUNT = "10000"


def worker_runtime_env() -> dict:
    """The job's runtime environment: OpenMP's idle threads spin ``WORKER_SPIN_COUNT`` rounds, unless
    the user set ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``, which then reach every worker as set; the
    driver's ``ROLL_CPU_THREADS`` (``roll.workers.base.cpu_threads``) reaches them too."""
    user = {name: os.environ[name] for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if name in os.environ}
    env = user or {"GOMP_SPINCOUNT": WORKER_SPIN_COUNT}
    if "ROLL_CPU_THREADS" in os.environ:
        env["ROLL_CPU_THREADS"] = os.environ["ROLL_CPU_THREADS"]
    return {"env_vars": env}
