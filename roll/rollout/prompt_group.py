"""What the rollout scheduler (``roll.rollout.scheduler``) plays for RLVR: one drawn prompt and its samples,
with the bookkeeping the scheduler and the batch (``roll.rollout.group_batch``) read. (An episode group is
``roll.rollout.episode_group``.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from roll.rollout.lifecycle import Sample
from roll.strategies.requests import SamplingParams

if TYPE_CHECKING:
    from roll.data.images import VisionInputs


@dataclass
class PromptGroup:
    """One drawn prompt and its samples."""

    group_id: int
    prompt_index: int
    samples: list[Sample]
    params: SamplingParams
    worker: int | None = None
    submit_version: int = 0  # weights version when its requests were sent
    kept: bool | None = None  # None until every sample is scored and the filters have spoken
    fallback: bool = False  # a filtered group that filled a batch once the prompt budget was spent
    vision: VisionInputs | None = None  # its prompt's images, made when it is sent

    @property
    def resolved(self) -> bool:
        return self.kept is not None

    @property
    def ready(self) -> bool:
        return bool(self.kept)

    @property
    def item(self) -> int:
        """What the prompt source drew for it."""
        return self.prompt_index

    def oldest_version(self) -> int | None:
        """The oldest weights version any of its tokens came from (submission version while unknown;
        None while unsent)."""
        if self.worker is None:
            return None
        versions = [v for s in self.samples if s.result for v in s.result.weight_versions]
        return min(versions, default=self.submit_version)
