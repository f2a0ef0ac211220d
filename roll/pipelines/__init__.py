"""Pipelines: the single-controller training loops, selected by the config's ``pipeline`` key."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from roll.utils.registry import Registry

PIPELINES: Registry[Callable[..., Any]] = Registry("pipeline")


@PIPELINES.register("rlvr")
def run_rlvr(config: Any, inputs: Any = None, **run_dir: Any) -> Any:
    from roll.pipelines.rlvr import RLVRPipeline

    return RLVRPipeline(config, inputs, **run_dir).run()


@PIPELINES.register("sft")
def run_sft(config: Any, inputs: Any = None, **run_dir: Any) -> Any:
    from roll.pipelines.sft import SFTPipeline

    return SFTPipeline(config, inputs, **run_dir).run()


@PIPELINES.register("agentic")
def run_agentic(config: Any, inputs: Any = None, **run_dir: Any) -> Any:
    if config.agent is not None:  # a user's agent program behind the endpoint, not an env
        from roll.pipelines.agent_programs import AgentProgramPipeline

        return AgentProgramPipeline(config, inputs, **run_dir).run()
    from roll.pipelines.agentic import AgenticPipeline

    return AgenticPipeline(config, inputs, **run_dir).run()


@PIPELINES.register("dpo")
def run_dpo(config: Any, inputs: Any = None, **run_dir: Any) -> Any:
    from roll.pipelines.dpo import DPOPipeline

    return DPOPipeline(config, inputs, **run_dir).run()


@PIPELINES.register("distill")
def run_distill(config: Any, inputs: Any = None, **run_dir: Any) -> Any:
    from roll.pipelines.distill import DistillPipeline

    return DistillPipeline(config, inputs, **run_dir).run()


def run_pipeline(config: Any, inputs: Any = None, resume: str | None = None, overwrite: bool = False) -> Any:
    """Run the pipeline that ``config.pipeline`` names; ``inputs`` is ``preflight(config)``'s result
    when the caller ran it already (it runs in the pipeline otherwise). ``resume`` (``"latest"`` or a
    checkpoint path) and ``overwrite`` decide what happens to a run already in ``output_dir``."""
    return PIPELINES.get(config.pipeline)(config, inputs, resume=resume, overwrite=overwrite)
