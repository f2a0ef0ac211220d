"""Peak host memory of each trainer rank while it loads its model and takes one step, on 2 ranks (gloo, this
CPU), loading by shards (``roll.strategies.sharded_load``) against loading the whole model on every rank
and then sharding it (the path before issue 59, still taken by the critic and a LoRA actor).

The model is shaped like Qwen2.5-0.5B (24 layers, hidden 896, 14 heads, 2 KV heads, a 151,936-token
vocabulary; random weights, float32 safetensors, about 2 GB) and saved once under ``--cache``. Each rank
is a process of its own; its peak resident memory is read for loading, then for one SFT step of 4 rows x
64 tokens; "base" is what a rank holds before any model (the interpreter, torch, transformers).
The optimizer's state (AdamW: 8 bytes a weight, sharded) is made at the step, so the step's peak is about
the same either way; loading is where the paths differ.

    python benchmarks/load_memory.py            # both paths, side by side
    python benchmarks/load_memory.py --layers 4 # a smaller model, for a quick look

The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch.multiprocessing as mp

PATHS = ("whole", "sharded")


def _peak_gb() -> float:
    """This process's peak resident memory since it started or since ``_reset_peak`` (``VmHWM``: unlike
    ``ru_maxrss``, not inherited from the process that spawned this one)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20  # kB
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size


def save_model(directory: Path, layers: int) -> Path:
    """A random Qwen2.5-0.5B-shaped model and a tiny tokenizer, saved once."""
    if (directory / "config.json").is_file():
        return directory
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from roll.models.tokenizer import build_char_tokenizer

    config = Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    build_char_tokenizer("0123456789+").save_pretrained(directory)
    return directory


def rank_main(rank: int, path: str, port: int, how: str, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    from roll.data.batch import Batch
    from roll.workers.actor import ActorSpec, ActorWorker, CrossEntropySpec, OptimizerSpec
    from roll.workers.base import ModelSpec

    if how == "whole":
        ActorWorker.model_builder = lambda self, spec: None  # the path before sharded loading
    spec = ActorSpec(
        model=ModelSpec(path=path),
        optimizer=OptimizerSpec(lr=1e-5, total_steps=1),
        micro_batch_size=4,
        loss=CrossEntropySpec(),
    )
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401 - imported before the base is read

    base = _peak_gb()  # the interpreter, torch and transformers: what any rank holds before a model
    worker = ActorWorker("actor", rank, 2, spec)
    worker.setup(master_addr="127.0.0.1", master_port=port)
    loaded = _peak_gb()
    _reset_peak()
    generator = torch.Generator().manual_seed(rank)
    rows, length = 4, 64
    batch = Batch(
        tensors={
            "prompt_ids": torch.randint(0, 12, (rows, length), generator=generator),
            "prompt_mask": torch.ones(rows, length, dtype=torch.long),
            "response_ids": torch.randint(0, 12, (rows, length), generator=generator),
            "response_mask": torch.ones(rows, length, dtype=torch.long),
        }
    )
    worker.train_step(batch)
    stepped = _peak_gb()
    report = worker.loaded()
    worker.shutdown()
    Path(out, f"{how}_{rank}.json").write_text(
        json.dumps({"base_gb": base, "load_gb": loaded, "step_gb": stepped, **report})
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "roll-bench-load-memory"))
    args = parser.parse_args()
    path = save_model(Path(args.cache) / f"qwen2.5-0.5b-shape-{args.layers}l", args.layers)
    results = {}
    with tempfile.TemporaryDirectory() as out:
        for how in PATHS:
            mp.spawn(rank_main, args=(str(path), free_port(), how, out), nprocs=2, join=True)
            results[how] = [json.loads(Path(out, f"{how}_{rank}.json").read_text()) for rank in range(2)]
    print(f"{'path':<8} {'rank':>4} {'read GB':>8} {'base GB':>8} {'loading GB':>11} {'step GB':>8}")
    for how, ranks in results.items():
        for rank, r in enumerate(ranks):
            read, base, load, step = r["bytes_read"] / 1e9, r["base_gb"], r["load_gb"], r["step_gb"]
            print(f"{how:<8} {rank:>4} {read:>8.2f} {base:>8.2f} {load:>11.2f} {step:>8.2f}")
    keys = ("bytes_read", "base_gb", "load_gb", "step_gb")
    worst = {how: {key: max(r[key] for r in ranks) for key in keys} for how, ranks in results.items()}
    sharded, whole = worst["sharded"], worst["whole"]
    ratio = {
        "bytes_read": sharded["bytes_read"] / whole["bytes_read"],
        "load_gb": sharded["load_gb"] / whole["load_gb"],
        "load_above_base": (sharded["load_gb"] - sharded["base_gb"]) / (whole["load_gb"] - whole["base_gb"]),
        "step_gb": sharded["step_gb"] / whole["step_gb"],
    }
    print(
        f"sharded / whole, worst rank: weights read {ratio['bytes_read']:.2f}x; peak while loading "
        f"{ratio['load_gb']:.2f}x ({ratio['load_above_base']:.2f}x above the base); peak in one step "
        f"{ratio['step_gb']:.2f}x"
    )
    print(json.dumps({"layers": args.layers, "results": results, "ratio": ratio}))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
