"""Preference pairs from a model's own samples (``roll pairs``): sample several answers per prompt, score
them with a reward, and keep the best as chosen and the worst as rejected where they differ.

This is the on-policy data DPO learns most from: the pairs are what the policy itself writes, so the loss
pushes probability between answers it actually gives. The pairs are written as text in TRL's standard
format (``prompt``, ``chosen``, ``rejected``), with the row's other fields kept; the DPO loader tokenises
them again and refuses a row whose prompt tokens would merge into its completion.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class PairStats:
    prompts: int  # prompts sampled
    pairs: int  # prompts whose samples' scores differed (one pair each)
    mean_score: float  # over every sample

    def summary(self) -> str:
        return (
            f"{self.pairs} pairs from {self.prompts} prompts ({self.prompts - self.pairs} had no two "
            f"non-empty samples that scored differently); mean sample score {self.mean_score:.3f}"
        )


def sample_preference_pairs(
    model_path: str,
    prompts_path: str,
    reward: str,
    samples_per_prompt: int = 8,
    max_new_tokens: int = 16,
    temperature: float = 1.0,
    seed: int = 0,
    batch_size: int = 256,
    max_prompt_length: int = 64,
) -> tuple[list[dict[str, Any]], PairStats]:
    """One pair per prompt of ``prompts_path`` whose non-empty samples' ``reward`` scores differ: the first
    sample with the highest score is chosen, the first with the lowest rejected."""
    import torch
    from transformers.utils import logging as hf_logging

    from roll.config.common import DataConfig
    from roll.data.prompts import load_prompts
    from roll.models.loading import end_of_sequence_ids, load_causal_lm, load_tokenizer
    from roll.pipelines.common import prompt_batch
    from roll.rewards import required_fields, score_response
    from roll.strategies.hf_generate import generate
    from roll.strategies.requests import SamplingParams

    hf_logging.disable_progress_bar()  # one shard of a small model needs no progress bar
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(model_path)
    model = load_causal_lm(model_path).eval()
    prompts = load_prompts(
        prompts_path, tokenizer, DataConfig(max_prompt_length=max_prompt_length), required_fields(reward)
    )
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    eos = end_of_sequence_ids(tokenizer, model)
    pairs, scores = [], []
    for indices in _batches(len(prompts), max(1, batch_size // samples_per_prompt)):
        batch = prompt_batch(prompts, indices, tokenizer.pad_token_id).repeat(samples_per_prompt)
        texts = generate(model, batch, params, eos, tokenizer.pad_token_id, tokenizer)["response_text"]
        for slot, index in enumerate(indices):
            answers = texts[slot * samples_per_prompt : (slot + 1) * samples_per_prompt]
            row, prompt_text = prompts.rows[index], prompts.texts[index]
            scored = [score_response(reward, prompt_text, text, row).score for text in answers]
            scores += scored
            # An empty answer (the end token at once) cannot be a completion of a pair.
            candidates = [(score, text) for score, text in zip(scored, answers) if text.strip()]
            if not candidates:
                continue
            best = max(candidates, key=lambda c: c[0])
            worst = min(candidates, key=lambda c: c[0])
            if best[0] > worst[0]:
                pairs.append({**row, "chosen": best[1], "rejected": worst[1]})
    return pairs, PairStats(len(prompts), len(pairs), sum(scores) / max(1, len(scores)))


def _batches(count: int, size: int) -> Iterator[list[int]]:
    for start in range(0, count, size):
        yield list(range(start, min(start + size, count)))


def write_jsonl(rows: list[dict[str, Any]], path: str | os.PathLike) -> None:
    """Write ``rows`` one JSON object per line, atomically."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.tmp")
    temporary.write_text("".join(json.dumps(row) + "\n" for row in rows))
    os.replace(temporary, target)
