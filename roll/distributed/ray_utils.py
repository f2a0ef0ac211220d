"""Start or join Ray for the single controller."""

from __future__ import annotations

import logging
import os

from roll.config.common import RayConfig


def init_ray(cfg: RayConfig) -> None:
    """Join ``cfg.address`` (or ``RAY_ADDRESS``) when set, else start a local Ray.

    A no-op when Ray is already running in this process."""
    import ray

    if ray.is_initialized():
        return
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    # Workers find `roll` through the installed package; keep Ray's own logs quiet so metrics stay readable.
    common = {"logging_level": logging.WARNING, "log_to_driver": True}
    if address:
        ray.init(address=address, **common)
    else:
        ray.init(num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus, include_dashboard=False, **common)
