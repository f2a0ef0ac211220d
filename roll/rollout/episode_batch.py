"""Finished episodes -> a training batch, in either layout.

- **Trajectory-wise** (``trajectory_batch``): one row per episode. The prompt is the first prompt; the
  response holds every turn and observation, with ``loss_mask`` on the sampled ids only; the score is
  the episode's return.
- **Step-wise** (``turn_batch``): one row per turn. The prompt is the context the turn was generated
  from (``Episode.turn_context``: a window of the episode), the response is the turn's sampled ids. Rows
  carry what the per-turn estimators read (``roll.algorithms.turn_advantages``): ``episode_index``,
  ``turn_index``, ``turn_rewards`` and ``anchor_index`` (turns of one group that acted from the same
  observation). The number of rows varies with the episodes' lengths, so the batch is padded to a
  multiple of ``divisor`` rows (``pad_evenly``) with copies marked ``padding``, whose ``loss_mask`` is 0
  and ``episode_index`` -1: nothing trains on them and no statistic counts them.

Episodes with pictures (a vision-language policy) give each row its pictures' pixel values (``IMAGES``):
the whole episode's, or the turn's window's.

``stop_policy`` (stop reason -> ``train``, ``mask`` or ``zero``) applies in both: ``mask`` keeps the
episode in its group's baseline with no token trained; ``zero`` trains it with every reward 0.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import torch

from roll.data.batch import Batch
from roll.data.images import IMAGES
from roll.data.padding import left_pad, right_pad
from roll.rollout.episode import Episode

__all__ = ["pad_evenly", "trajectory_batch", "turn_batch"]


def trajectory_batch(
    episodes: Sequence[Episode],
    group_index: Sequence[int],
    episode_ids: Sequence[str],
    stop_policy: Mapping[str, str],
    pad_id: int,
) -> Batch:
    """One row per episode: the prompt left-padded, the response (turns and observations) right-padded,
    the loss mask on the sampled tokens, the score its return (after the stop policy)."""
    prompt_ids, prompt_mask = left_pad([e.prompt_ids for e in episodes], pad_id)
    response_ids, response_mask = right_pad([e.response_ids or [pad_id] for e in episodes], pad_id)
    width = response_ids.shape[1]
    trained = torch.zeros(len(episodes), width, dtype=response_mask.dtype)
    logprobs = torch.zeros(len(episodes), width)
    scores = []
    for row, episode in enumerate(episodes):
        rule = _rule(stop_policy, episode)
        n = len(episode.response_ids)
        if rule != "mask":
            trained[row, :n] = torch.tensor(episode.loss_mask, dtype=trained.dtype)
        logprobs[row, :n] = torch.tensor(episode.logprobs)
        scores.append(0.0 if rule == "zero" else episode.episode_return)
        if n == 0:
            response_mask[row] = 0
    return Batch(
        tensors={
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "response_ids": response_ids,
            "response_mask": response_mask,
            "loss_mask": trained,
            "rollout_logprobs": logprobs,
            "group_index": torch.tensor(list(group_index)),
            "scores": torch.tensor(scores, dtype=torch.float32),
        },
        non_tensors={
            "seed": [e.seed for e in episodes],
            "stop_reason": [e.stop_reason.value for e in episodes],
            "token_rewards": [None] * len(episodes),
            "episode_id": list(episode_ids),
            **_pictures([e.vision_inputs(e.images()) for e in episodes]),
        },
    )


def _pictures(vision: list) -> dict[str, list]:
    """The batch's ``IMAGES`` field, where any row has pictures."""
    return {IMAGES: vision} if any(v is not None for v in vision) else {}


def turn_batch(
    episodes: Sequence[Episode],
    group_index: Sequence[int],
    episode_ids: Sequence[str],
    stop_policy: Mapping[str, str],
    pad_id: int,
    divisor: int = 1,
) -> Batch:
    """One row per turn of every episode, padded to a multiple of ``divisor`` rows (see the module
    docstring). An episode's rows come in turn order; each row's score is its episode's return."""
    prompts, responses, logprobs, trained = [], [], [], []
    fields: dict[str, list] = {
        key: [] for key in ("group_index", "episode_index", "turn_index", "turn_rewards", "anchor_index")
    }
    scores, seeds, reasons, ids, vision = [], [], [], [], []
    anchors: dict[tuple[int, Hashable], int] = {}
    for index, (episode, group, episode_id) in enumerate(zip(episodes, group_index, episode_ids)):
        rule = _rule(stop_policy, episode)
        for k, turn in enumerate(episode.turns):
            prompts.append(episode.turn_context(k))
            vision.append(episode.vision_inputs(episode.turn_images(k)))
            responses.append(episode.response_ids[turn.start : turn.end])
            logprobs.append(episode.logprobs[turn.start : turn.end])
            trained.append(rule != "mask")
            fields["group_index"].append(group)
            fields["episode_index"].append(index)
            fields["turn_index"].append(k)
            fields["turn_rewards"].append(0.0 if rule == "zero" else turn.reward)
            fields["anchor_index"].append(anchors.setdefault((group, turn.observation), len(anchors)))
            scores.append(0.0 if rule == "zero" else episode.episode_return)
            seeds.append(episode.seed)
            reasons.append(episode.stop_reason.value)
            ids.append(episode_id)
    if not prompts:
        raise RuntimeError("no episode of this step played a turn: there is nothing to train on")
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)
    response_ids, response_mask = right_pad(responses, pad_id)
    rollout_logprobs = torch.zeros(response_ids.shape)
    for row, values in enumerate(logprobs):
        rollout_logprobs[row, : len(values)] = torch.tensor(values)
    loss_mask = response_mask * torch.tensor(trained, dtype=response_mask.dtype).unsqueeze(1)
    batch = Batch(
        tensors={
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "response_ids": response_ids,
            "response_mask": response_mask,
            "loss_mask": loss_mask,
            "rollout_logprobs": rollout_logprobs,
            "scores": torch.tensor(scores, dtype=torch.float32),
            "turn_rewards": torch.tensor(fields.pop("turn_rewards"), dtype=torch.float32),
            **{key: torch.tensor(values) for key, values in fields.items()},
        },
        non_tensors={
            "seed": seeds,
            "stop_reason": reasons,
            "token_rewards": [None] * len(prompts),
            "episode_id": ids,
            **_pictures(vision),
        },
    )
    return pad_evenly(batch, divisor)


def pad_evenly(batch: Batch, divisor: int) -> Batch:
    """``batch`` padded to a multiple of ``divisor`` rows, as ``divisor`` equal chunks in order (data-
    parallel shards, then mini-batches within a shard): each chunk holds its share of the real rows (as
    even as can be), then copies of its first row as padding. Padding all at the end could leave a
    whole mini-batch of filler, and an optimizer step on it would move the weights by momentum alone.

    Padding rows have ``padding`` True, ``loss_mask`` 0 and ``episode_index``/``anchor_index`` (where the
    batch has them) -1."""
    real = len(batch)
    base, extra = divmod(real, divisor)
    size = base + (extra > 0)
    rows, padding, start = [], [], 0
    for chunk in range(divisor):
        count = base + (chunk < extra)
        filler = size - count
        rows += list(range(start, start + count)) + [min(start, real - 1)] * filler
        padding += [False] * count + [True] * filler
        start += count
    batch = batch.select(rows)
    fill = torch.tensor(padding)
    batch["padding"] = fill
    batch["loss_mask"][fill] = 0
    for key in ("episode_index", "anchor_index"):
        if key in batch:
            batch[key][fill] = -1
    return batch


def _rule(stop_policy: Mapping[str, str], episode: Episode) -> str:
    return stop_policy.get(episode.stop_reason.value, "train")
