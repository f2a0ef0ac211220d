"""Pipelines: the single-controller training loops, selected by the config's ``pipeline`` key."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from roll.utils.registry import Registry

PIPELINES: Registry[Callable[[Any], Any]] = Registry("pipeline")


@PIPELINES.register("rlvr")
def run_rlvr(config: Any) -> Any:
    from roll.pipelines.rlvr import RLVRPipeline

    return RLVRPipeline(config).run()


@PIPELINES.register("sft")
def run_sft(config: Any) -> Any:
    from roll.pipelines.sft import SFTPipeline

    return SFTPipeline(config).run()


def run_pipeline(config: Any) -> Any:
    """Run the pipeline that ``config.pipeline`` names."""
    return PIPELINES.get(config.pipeline)(config)
