"""Peak host memory of each rank of a model role while it loads its model and takes one step, on 2 ranks
(gloo, this CPU), before and after issue 59:

- ``actor``: loading by shards (``roll.strategies.sharded_load``) against loading the whole model on every
  rank and then sharding it (the path before; still taken by a checkpoint without safetensors files);
- ``reference``: a reference sharded by FSDP2 (each rank reads and holds 1/N of the weights) against a
  whole replica on every rank; its step is one scoring pass (``compute_logprobs``);
- ``lora``: a LoRA actor computing in bf16 whose frozen base is read by shards and held in bf16 against
  one loading it whole on every rank and holding it in float32 (the adapter keeps float32 masters either
  way).

The model is shaped like Qwen2.5-0.5B (24 layers, hidden 896, 14 heads, 2 KV heads, a 151,936-token
vocabulary; random weights, float32 safetensors, about 2 GB) and saved once under ``--cache``. Each rank
is a process of its own; its peak resident memory is read for loading, then for one step of 4 rows x
64 tokens (an SFT step for the trainers); "base" is what a rank holds before any model (the interpreter,
torch, transformers), "held" the bytes of the weights it holds (its shards when sharded). A trainer's
optimizer state (AdamW: 8 bytes a trained weight, sharded) is made at the step, so its step peak is about
the same either way; loading is where the actor's paths differ.

    python benchmarks/load_memory.py                   # every role, both paths side by side
    python benchmarks/load_memory.py --roles reference # one role
    python benchmarks/load_memory.py --layers 4        # a smaller model, for a quick look

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

# Each role's two paths, before and after.
PATHS = {
    "actor": ("whole", "sharded"),
    "reference": ("whole", "sharded"),
    "lora": ("whole-fp32", "sharded-bf16"),
}


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


def rank_main(rank: int, path: str, port: int, role: str, how: str, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    from roll.data.batch import Batch
    from roll.strategies.fsdp import local_tensor
    from roll.strategies.lora import LoraSpec
    from roll.workers.actor import ActorSpec, ActorWorker, CrossEntropySpec, OptimizerSpec
    from roll.workers.base import ModelSpec
    from roll.workers.reference import ReferenceSpec, ReferenceWorker

    if how.startswith("whole"):
        import roll.strategies.sharded_load

        roll.strategies.sharded_load.checkpoint_index = lambda path: None  # the path before: all of it
    if role == "reference" and how == "whole":
        import roll.models.loading

        load = roll.models.loading.load_causal_lm

        def copied(*args: object, **kwargs: object) -> torch.nn.Module:
            # transformers leaves float32 weights memory-mapped from the files (pages counted only once
            # touched); a device holds a copy of every weight, as ``.to("cuda")`` makes.
            model = load(*args, **kwargs)
            for param in model.parameters():
                param.data = param.data.clone()
            return model

        roll.models.loading.load_causal_lm = copied
    if role == "lora" and how == "whole-fp32":
        ActorWorker.weights_dtype = lambda self, spec: "float32"  # the base held as trainers hold weights
    if role == "reference":
        worker = ReferenceWorker("reference", rank, 2, ReferenceSpec(ModelSpec(path=path)))
    else:
        lora = LoraSpec(rank=16, alpha=32.0) if role == "lora" else None
        spec = ActorSpec(
            model=ModelSpec(path=path, dtype="bfloat16" if lora else "float32"),
            optimizer=OptimizerSpec(lr=1e-5, total_steps=1),
            micro_batch_size=4,
            loss=CrossEntropySpec(),
            lora=lora,
        )
        worker = ActorWorker("actor", rank, 2, spec)
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401 - imported before the base is read

    base = _peak_gb()  # the interpreter, torch and transformers: what any rank holds before a model
    worker.setup(master_addr="127.0.0.1", master_port=port)
    loaded = _peak_gb()
    held = sum(local_tensor(p).numel() * local_tensor(p).element_size() for p in worker.model.parameters())
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
    if role == "reference":
        worker.compute_logprobs(batch)
    else:
        worker.train_step(batch)
    stepped = _peak_gb()
    report = worker.loaded()
    worker.shutdown()
    Path(out, f"{role}_{how}_{rank}.json").write_text(
        json.dumps({"base_gb": base, "load_gb": loaded, "step_gb": stepped, "held_bytes": held, **report})
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--roles", nargs="+", choices=list(PATHS), default=list(PATHS))
    parser.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "roll-bench-load-memory"))
    args = parser.parse_args()
    path = save_model(Path(args.cache) / f"qwen2.5-0.5b-shape-{args.layers}l", args.layers)
    results: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory() as out:
        for role in args.roles:
            for how in PATHS[role]:
                mp.spawn(rank_main, args=(str(path), free_port(), role, how, out), nprocs=2, join=True)
                ranks = [json.loads(Path(out, f"{role}_{how}_{rank}.json").read_text()) for rank in range(2)]
                results.setdefault(role, {})[how] = ranks
    columns = ("read GB", "held GB", "base GB", "loading GB", "step GB")
    print(f"{'role':<9} {'path':<12} {'rank':>4} " + " ".join(f"{c:>{max(8, len(c))}}" for c in columns))
    for role, paths in results.items():
        for how, ranks in paths.items():
            for rank, r in enumerate(ranks):
                numbers = [
                    r["bytes_read"] / 1e9,
                    r["held_bytes"] / 1e9,
                    r["base_gb"],
                    r["load_gb"],
                    r["step_gb"],
                ]
                read, held, base, load, step = numbers
                print(
                    f"{role:<9} {how:<12} {rank:>4} {read:>8.2f} {held:>8.2f} {base:>8.2f} {load:>11.2f} "
                    f"{step:>8.2f}"
                )
    keys = ("bytes_read", "held_bytes", "base_gb", "load_gb", "step_gb")
    ratios = {}
    for role, paths in results.items():
        worst = {how: {key: max(r[key] for r in ranks) for key in keys} for how, ranks in paths.items()}
        before, after = (worst[how] for how in PATHS[role])
        ratio = ratios[role] = {
            "bytes_read": after["bytes_read"] / before["bytes_read"],
            "held_bytes": after["held_bytes"] / before["held_bytes"],
            "load_gb": after["load_gb"] / before["load_gb"],
            "load_above_base": (after["load_gb"] - after["base_gb"])
            / (before["load_gb"] - before["base_gb"]),
            "step_gb": after["step_gb"] / before["step_gb"],
        }
        print(
            f"{role}: {' / '.join(reversed(PATHS[role]))}, worst rank: weights read "
            f"{ratio['bytes_read']:.2f}x, "
            f"held {ratio['held_bytes']:.2f}x; peak while loading {ratio['load_gb']:.2f}x "
            f"({ratio['load_above_base']:.2f}x above the base); peak in one step {ratio['step_gb']:.2f}x"
        )
    print(json.dumps({"layers": args.layers, "results": results, "ratio": ratios}))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
