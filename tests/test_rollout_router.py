"""Single requests routed over data-parallel rollout workers (the load balancer's Ray path)."""

from __future__ import annotations

import dataclasses

import pytest

from roll.data.prompts import PromptSet, render_prompt
from roll.distributed.cluster import Cluster, WorkerError
from roll.distributed.router import RolloutRouter
from roll.models.loading import load_tokenizer
from roll.pipelines.common import prompt_batch
from roll.strategies.sampling import SamplingParams
from roll.workers.base import ModelSpec
from roll.workers.rollout import RolloutWorker

pytestmark = pytest.mark.usefixtures("ray_session")


@dataclasses.dataclass
class Holder:
    model: ModelSpec


def test_requests_spread_over_workers_and_match_batch_generation(tiny_model_path):
    tokenizer = load_tokenizer(tiny_model_path)
    rows = [{"prompt": f"{a}+{b}"} for a, b in [(1, 2), (30, 4), (55, 45), (9, 9)]]
    texts = [render_prompt(tokenizer, r["prompt"], True) for r in rows]
    prompts = PromptSet(rows, texts, [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts])
    greedy = SamplingParams(max_new_tokens=6, greedy=True)
    rollout = Cluster("rollout", RolloutWorker, 2, Holder(ModelSpec(path=tiny_model_path)))
    try:
        rollout.setup()
        router = RolloutRouter(rollout, timeout_s=30)
        ids = [router.submit(ids, greedy) for ids in prompts.token_ids]
        assert router.in_flight() == [2, 2], "the balancer alternates between idle workers"
        results = [router.result(request_id) for request_id in ids]
        assert router.in_flight() == [0, 0]

        expected = rollout.generate(prompt_batch(prompts, [0, 1, 2, 3], tokenizer.pad_token_id), greedy)
        for row, result in enumerate(results):
            kept = expected["response_ids"][row][expected["response_mask"][row].bool()].tolist()
            assert result.token_ids == kept
            assert result.finish_reason == expected["finish_reason"][row]

        # An abort either lands (the result says so) or comes after the end (it reports False).
        request_id = router.submit(prompts.token_ids[0], SamplingParams(max_new_tokens=20))
        aborted = router.abort(request_id)
        assert (router.result(request_id).finish_reason == "abort") == aborted
        with pytest.raises(KeyError, match="unknown request id"):
            router.abort("never-submitted")
        with pytest.raises(ValueError, match="empty prompt"):
            router.submit([], greedy)
        # Remote failures name the role and the rank that served the request.
        bad = router.submit([10**6], greedy)
        with pytest.raises(WorkerError, match=r"rollout rank 0 failed in await_result"):
            router.result(bad)
        assert router.in_flight() == [0, 0]
    finally:
        rollout.kill()
