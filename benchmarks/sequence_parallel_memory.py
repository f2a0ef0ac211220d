"""Peak memory per rank of one training forward + backward over a long packed sequence: one rank holding
all of it (S=1) against two ranks of a sequence group holding half each (S=2, Ulysses,
``roll.strategies.sequence_parallel``), at a real vocabulary (151,936, Qwen2's).

Each rank is its own process (two gloo ranks on this machine for S=2), so each peak RSS is that rank's
alone; "saved" is what autograd keeps for the backward pass (the activations: every saved tensor's
storage once, the weights not counted), "added" is the peak RSS above the rank's memory once its model is
loaded: the pass's activations, gradients and workspace, and its growth above a short (512-token) pass is
the part that grows with the sequence (the head's chunk of logits and the weights' gradients are the same
at any length). The model is a random two-block Qwen2 (hidden 512, 8 query and 4 KV heads) in float32
with ``sdpa_varlen`` (the packed kernel sequence parallelism needs); the pass is the train step's: the
response tokens' logprobs through the streamed head, then the backward of their mean.

    python benchmarks/sequence_parallel_memory.py                       # 8k and 16k response tokens
    python benchmarks/sequence_parallel_memory.py --responses 4096      # a quicker look

The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from generation_memory import VOCAB, build_large_vocab_model  # this directory: run as a script

PROMPT = 64


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def build_model(directory: Path, max_positions: int) -> str:
    shape = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=8)
    return build_large_vocab_model(directory, max_positions, num_key_value_heads=4, **shape)


def run_rank(size: int, rank: int, port: int, model_path: str, response: int) -> dict:
    import torch
    import torch.distributed as dist

    from roll.data.batch import Batch
    from roll.models.loading import load_causal_lm
    from roll.strategies.hf_forward import response_logprobs
    from roll.strategies.sequence_parallel import new_sequence_group, set_sequence_group

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    model = load_causal_lm(model_path, attn_implementation="sdpa_varlen")
    model.train()
    if size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
        set_sequence_group(model, new_sequence_group(size))
    generator = torch.Generator().manual_seed(0)
    batch = Batch(
        tensors={
            "prompt_ids": torch.randint(2, VOCAB, (1, PROMPT), generator=generator),
            "prompt_mask": torch.ones(1, PROMPT, dtype=torch.long),
            "response_ids": torch.randint(2, VOCAB, (1, response), generator=generator),
            "response_mask": torch.ones(1, response, dtype=torch.long),
        }
    )
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}  # the activations autograd keeps for backward, by storage

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    before = _rss_gb()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        logprobs, _ = response_logprobs(model, batch)
    (-logprobs.mean()).backward()
    logprobs = logprobs.detach()
    seconds, peak = time.perf_counter() - start, _rss_gb()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if size > 1:
        for grad in grads:  # a rank's gradient is its tokens' part: the group's sum is the whole
            dist.all_reduce(grad)
        dist.destroy_process_group()
    grad_sum = sum(float(grad.double().abs().sum()) for grad in grads)
    return {
        "size": size,
        "rank": rank,
        "response": response,
        "loaded_gb": round(before, 3),
        "peak_gb": round(peak, 3),
        "added_gb": round(peak - before, 3),
        "saved_gb": round(sum(saved.values()) / 2**30, 3),
        "seconds": round(seconds, 1),
        "logprob_sum": float(logprobs.double().sum()),
        "grad_abs_sum": grad_sum,
    }


def measure(size: int, model_path: str, response: int) -> list[dict]:
    from roll.distributed.ports import free_port

    port = free_port("127.0.0.1")
    commands = [
        [sys.executable, __file__, "--rank", str(size), str(rank), str(port), model_path, str(response)]
        for rank in range(size)
    ]
    processes = [subprocess.Popen(c, stdout=subprocess.PIPE, text=True) for c in commands]
    outputs = [p.communicate(timeout=3600)[0] for p in processes]
    if any(p.returncode for p in processes):
        raise RuntimeError(f"a rank failed: exit codes {[p.returncode for p in processes]}")
    return [json.loads(out.strip().splitlines()[-1]) for out in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--responses", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--base", type=int, default=512, help="the short pass whose memory is the fixed part")
    parser.add_argument("--rank", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        size, rank, port, model_path, response = args.rank
        print(json.dumps(run_rank(int(size), int(rank), int(port), model_path, int(response))))
        return
    rows, summary, base = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        model_path = build_model(Path(tmp) / "model", PROMPT + max(args.responses))
        for response in [args.base, *args.responses]:
            one = measure(1, model_path, response)[0]
            two = measure(2, model_path, response)
            rows += [one, *two]
            most = max(r["added_gb"] for r in two)
            most_saved = max(r["saved_gb"] for r in two)
            if response == args.base:  # the fixed part: the head's chunk of logits, the weights' gradients
                base = {1: one["added_gb"], 2: most}
                continue
            grows = (one["added_gb"] - base[1], most - base[2])
            summary[response] = {
                "s1_saved_gb": one["saved_gb"],
                "s2_saved_gb_per_rank": most_saved,
                "saved_ratio": round(most_saved / one["saved_gb"], 3),
                "s1_added_gb": one["added_gb"],
                "s2_added_gb_per_rank": most,
                "ratio": round(most / one["added_gb"], 2),
                "s1_growth_gb": round(grows[0], 3),
                "s2_growth_gb_per_rank": round(grows[1], 3),
                "growth_ratio": round(grows[1] / max(grows[0], 1e-9), 2),
                "same_logprobs": abs(two[0]["logprob_sum"] - one["logprob_sum"])
                < 1e-3 * abs(one["logprob_sum"]),
                "same_grads": abs(two[0]["grad_abs_sum"] - one["grad_abs_sum"]) < 1e-4 * one["grad_abs_sum"],
            }
    print(f"one packed sequence of {PROMPT} prompt + N response tokens, vocabulary {VOCAB}, float32, CPU")
    print(
        f"{'N':>6} {'S':>2} {'rank':>4} {'loaded GB':>10} {'saved GB':>9} {'added GB':>9} "
        f"{'peak GB':>8} {'s':>6}"
    )
    for r in rows:
        print(
            f"{r['response']:>6} {r['size']:>2} {r['rank']:>4} {r['loaded_gb']:>10.2f} {r['saved_gb']:>9.3f} "
            f"{r['added_gb']:>9.2f} {r['peak_gb']:>8.2f} {r['seconds']:>6.1f}"
        )
    for response, s in summary.items():
        print(
            f"N={response}: S=2 keeps {s['saved_ratio']}x of S=1's activations for backward per rank, "
            f"adds {s['ratio']}x of its peak RSS; above the {args.base}-token "
            f"pass (what grows with the sequence) {s['growth_ratio']}x (same logprobs: "
            f"{s['same_logprobs']}, same gradients: {s['same_grads']})"
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
