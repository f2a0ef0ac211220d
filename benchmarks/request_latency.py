"""Benchmark: what one short generate request costs through a rollout worker, next to generating in process.

Four ways to get one response of ``--new-tokens`` tokens to one prompt from the quickstart's tiny model,
in one run, alternating round by round so that a change in the machine's load hits all of them:

* ``hf_generate``: Hugging Face ``generate`` in this process (``roll.strategies.hf_generate``), the
  floor: what TRL does.
* ``engine``: ROLL's engine (``HFEngine``) in this process, ``submit`` then ``await_result``: the serving
  thread's hand-offs, without Ray.
* ``worker await``: the same through a ``RolloutWorker`` on Ray, ``submit`` then a blocking
  ``await_result`` call (two Ray round trips).
* ``worker collect``: the rollout scheduler's path, ``submit_many`` then ``collect_finished`` (two Ray
  round trips, the second one waiting on the worker until the result is in).

Plus the bare Ray round trip of a no-op call to the same worker for scale. Greedy decoding of the same
weights, so every path produces the same tokens (checked); medians over ``--rounds`` rounds after
``--warmup``.

Run from the repository root::

    python benchmarks/request_latency.py [--new-tokens 4] [--rounds 200]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args(argv)

    import ray
    import torch

    from roll.config.loader import load_config
    from roll.data.prompts import render_prompt
    from roll.distributed.cluster import Cluster
    from roll.distributed.ray_utils import worker_runtime_env
    from roll.models.loading import end_of_sequence_ids, load_causal_lm, load_tokenizer
    from roll.models.tiny import save_tiny_model
    from roll.strategies import hf_generate
    from roll.strategies.infer.hf import HFEngine
    from roll.strategies.requests import GenerateRequest, SamplingParams
    from roll.workers.base import ModelSpec
    from roll.workers.rollout import RolloutSpec, RolloutWorker

    os.chdir(REPO)
    cfg = load_config("examples/quickstart.yaml", [])
    directory = Path(tempfile.mkdtemp(prefix="roll-request-latency-"))
    path = str(save_tiny_model(cfg.model.tiny, directory / "model"))
    tokenizer = load_tokenizer(path)
    text = render_prompt(tokenizer, "12+34", cfg.data.apply_chat_template)  # as the quickstart renders it
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_new_tokens=args.new_tokens, greedy=True)
    model = load_causal_lm(path).eval()
    batch = _prompt_batch(prompt, tokenizer.pad_token_id)
    eos = end_of_sequence_ids(tokenizer, model)
    engine = HFEngine(load_causal_lm(path), tokenizer, "cpu")
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, runtime_env=worker_runtime_env())
    rollout = Cluster("rollout", RolloutWorker, 1, RolloutSpec(model=ModelSpec(path=path)))
    rollout.setup()
    counter = iter(range(10**9))

    def in_process_generate() -> list[int]:
        out = hf_generate.generate(model, batch, params, eos, tokenizer.pad_token_id)
        return out["response_ids"][0][out["response_mask"][0].bool()].tolist()

    def in_process_engine() -> list[int]:
        request_id = f"e{next(counter)}"
        engine.submit(GenerateRequest(request_id, prompt, params))
        return engine.await_result(request_id, 30).token_ids

    def worker_await() -> list[int]:
        request_id = f"a{next(counter)}"
        rollout.call_rank(0, "submit", GenerateRequest(request_id, prompt, params))
        return rollout.call_rank(0, "await_result", request_id, 30).token_ids

    def worker_collect() -> list[int]:
        request_id = f"c{next(counter)}"
        rollout.call_rank(0, "submit_many", [GenerateRequest(request_id, prompt, params)])
        got: list = []
        while not got:
            got = rollout.call_rank(0, "collect_finished", 5.0)
        return got[0].token_ids

    def ping() -> None:
        rollout.call_rank(0, "device_type")

    paths: dict[str, Callable[[], list[int] | None]] = {
        "hf_generate (in process)": in_process_generate,
        "engine (in process)": in_process_engine,
        "worker: submit + await_result": worker_await,
        "worker: submit_many + collect_finished": worker_collect,
        "worker: no-op call (Ray round trip)": ping,
    }
    times: dict[str, list[float]] = {name: [] for name in paths}
    responses: dict[str, set[tuple[int, ...]]] = {name: set() for name in paths}
    try:
        for round_index in range(args.warmup + args.rounds):
            for name, call in paths.items():
                start = time.perf_counter()
                tokens = call()
                if round_index >= args.warmup:
                    times[name].append(time.perf_counter() - start)
                if tokens is not None:
                    responses[name].add(tuple(tokens))
    finally:
        engine.shutdown()
        rollout.kill()
        ray.shutdown()
        shutil.rmtree(directory, ignore_errors=True)

    produced = {tokens for name, seen in responses.items() for tokens in seen}
    if len(produced) != 1:
        raise AssertionError(f"the paths decoded different responses: {responses}")
    length = len(next(iter(produced)))
    floor = statistics.median(times["hf_generate (in process)"])
    print(
        f"\nmachine: {os.cpu_count()} CPU cores, torch {torch.__version__}, ray {ray.__version__}; "
        f"quickstart model, one prompt of {len(prompt)} tokens, a greedy response of {length} tokens "
        f"(max_new_tokens {args.new_tokens}); medians of {args.rounds} rounds after {args.warmup}\n"
    )
    print("| path | median ms | p90 ms | minus hf_generate ms |")
    print("| --- | --- | --- | --- |")
    for name, values in times.items():
        median = statistics.median(values)
        p90 = statistics.quantiles(values, n=10)[-1]
        print(f"| {name} | {median * 1e3:.2f} | {p90 * 1e3:.2f} | {(median - floor) * 1e3:+.2f} |")
    return 0


def _prompt_batch(prompt: list[int], pad_id: int):
    import torch

    from roll.data.batch import Batch

    ids = torch.tensor([prompt])
    return Batch(tensors={"prompt_ids": ids, "prompt_mask": torch.ones_like(ids)})


if __name__ == "__main__":
    sys.exit(main())
