"""The RLVR training batch of scored prompt groups (``roll.rollout.scheduler``): one row per sample, groups
in the order their prompts were drawn, samples in order; the layout batch generation of the same prompts
gives. (The agentic batch is ``roll.rollout.episode_batch``.)"""

from __future__ import annotations

import torch

from roll.data.batch import Batch
from roll.data.images import IMAGES
from roll.data.padding import left_pad, right_pad
from roll.data.prompts import PromptSet
from roll.rollout.prompt_group import PromptGroup


def assemble_batch(groups: list[PromptGroup], prompts: PromptSet, pad_id: int, max_new_tokens: int) -> Batch:
    """The training batch of scored ``groups``: rows in group order, samples in order, responses
    right-padded to the longest budget (at least ``max_new_tokens``) — the layout batch generation of the
    same prompts gives."""
    samples = [s for g in groups for s in g.samples]
    prompt_index = [g.prompt_index for g in groups for _ in g.samples]
    prompt_ids, prompt_mask = left_pad([prompts.token_ids[i] for i in prompt_index], pad_id)
    results = [s.result for s in samples]
    width = max(max_new_tokens, *(g.params.max_new_tokens for g in groups))
    response_ids, response_mask = right_pad([r.token_ids for r in results], pad_id, width)
    logprobs = torch.zeros(len(samples), width)
    for row, result in enumerate(results):
        logprobs[row, : len(result.logprobs)] = torch.tensor(result.logprobs)
    images = {IMAGES: [g.vision for g in groups for _ in g.samples]} if prompts.images is not None else {}
    return Batch(
        tensors={
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "response_ids": response_ids,
            "response_mask": response_mask,
            "rollout_logprobs": logprobs,
            "group_index": torch.tensor([i for i, g in enumerate(groups) for _ in g.samples]),
            "scores": torch.tensor([s.score for s in samples], dtype=torch.float32),
        },
        non_tensors={
            "prompt_text": [prompts.texts[i] for i in prompt_index],
            "sample": [prompts.rows[i] for i in prompt_index],
            "response_text": [s.response_text for s in samples],
            "finish_reason": [r.finish_reason for r in results],
            "token_rewards": [s.token_rewards for s in samples],
            "domain": [prompts.domain_of(i) for i in prompt_index],
            "reward_info": [s.reward_info for s in samples],
            **images,
        },
    )
