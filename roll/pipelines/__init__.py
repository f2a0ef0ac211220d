"""Pipelines: the single-controller training loops, selected by the config's ``pipeline`` key."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from roll.utils.registry import Registry

PIPELINES: Registry[Callable[..., Any]] = Registry("pipeline")


@PIPELINES.register("rlvr")
def run_rlvr(config: Any, inputs: Any = None) -> Any:
    from roll.pipelines.rlvr import RLVRPipeline

    return RLVRPipeline(config, inputs).run()


@PIPELINES.register("sft")
def run_sft(config: Any, inputs: Any = None) -> Any:
    from roll.pipelines.sft import SFTPipeline

    return SFTPipeline(config, inputs).run()


def run_pipeline(config: Any, inputs: Any = None) -> Any:
    """Run the pipeline that ``config.pipeline`` names; ``inputs`` is ``preflight(config)``'s result
    when the caller ran it already (it runs in the pipeline otherwise)."""
    return PIPELINES.get(config.pipeline)(config, inputs)
