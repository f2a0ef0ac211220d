"""Trainer throughput on one long packed sequence, by the protocol of prime-rl's public trainer benchmark
(``benchmarks/results/BENCHMARKS.md`` there): Qwen3-0.6B's shape with random weights, one packed
16k-token sequence per micro-batch, 2 micro-batches per step, full activation checkpointing, bf16
(mixed precision: float32 masters), one GPU. Their row for one H100: 11.9k tokens/s, 11.1% MFU, 12.5 GiB.

The real actor worker in this process (``ActorWorker``, one rank: FSDP2 mixed precision, AdamW,
``sdpa_varlen`` packing, the streamed head), a policy-loss step per iteration. Prints tokens/s, MFU
(6 x the non-embedding weights + 6 x the head per token, plus causal attention's 6 x layers x length x
heads x head dim; the recomputation of checkpointing not counted) and the peak of allocated memory.

    python benchmarks/long_sequence_gpu.py                 # on a GPU: the protocol above
    python benchmarks/long_sequence_gpu.py --tiny          # on a CPU: the same code on a small shape

The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

VOCAB = 151_936
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}  # dense, SXM


def qwen3_config(tiny: bool, length: int):
    from transformers import Qwen3Config

    if tiny:
        shape = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16)  # fmt: skip
    else:  # Qwen3-0.6B
        shape = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=128)  # fmt: skip
    return Qwen3Config(vocab_size=VOCAB, max_position_embeddings=length, tie_word_embeddings=True, **shape)


def save_model(config, directory: Path) -> str:
    import torch
    from transformers import Qwen3ForCausalLM

    from roll.models.tokenizer import build_char_tokenizer

    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(directory)
    build_char_tokenizer("0123456789+").save_pretrained(directory)  # the worker loads one; ids are random
    return str(directory)


def flops_per_token(config, length: int) -> float:
    embedding = config.vocab_size * config.hidden_size
    layer = 4 * config.hidden_size * config.num_attention_heads * config.head_dim  # q, o (k, v below)
    layer += 4 * config.hidden_size * config.num_key_value_heads * config.head_dim
    layer += 3 * config.hidden_size * config.intermediate_size
    weights = config.num_hidden_layers * layer / 2 + embedding  # the head's matmul (tied: counted once)
    attention = 6 * config.num_hidden_layers * length * config.num_attention_heads * config.head_dim
    return 6 * weights + attention


def main() -> None:
    import torch

    from roll.data.batch import Batch
    from roll.workers.actor import ActorSpec, ActorWorker, OptimizerSpec, PolicyLossSpec
    from roll.workers.base import ModelSpec

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a small shape, for a CPU")
    parser.add_argument("--length", type=int, default=16384, help="tokens per packed sequence")
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="measured steps, after one warm-up step")
    args = parser.parse_args()
    length = 512 if args.tiny else args.length
    config = qwen3_config(args.tiny, length)
    with tempfile.TemporaryDirectory() as tmp:
        path = save_model(config, Path(tmp) / "model")
        spec = ActorSpec(
            model=ModelSpec(path=path, dtype="bfloat16", attn_implementation="sdpa_varlen"),
            optimizer=OptimizerSpec(lr=1e-6, total_steps=args.steps + 1),
            micro_batch_size=1,  # one packed sequence per micro-batch
            loss=PolicyLossSpec(),
            gradient_checkpointing=True,
        )
        worker = ActorWorker("actor", 0, 1, spec)
        worker.setup()
        device = worker.device
        rows, prompt = args.micro_batches, 256
        generator = torch.Generator().manual_seed(0)
        batch = Batch(
            tensors={
                "prompt_ids": torch.randint(2, VOCAB, (rows, prompt), generator=generator),
                "prompt_mask": torch.ones(rows, prompt, dtype=torch.long),
                "response_ids": torch.randint(2, VOCAB, (rows, length - prompt), generator=generator),
                "response_mask": torch.ones(rows, length - prompt, dtype=torch.long),
                "advantages": torch.randn(rows, length - prompt, generator=generator),
            }
        )

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize()

        worker.train_step(batch)  # warm-up: allocator, kernels
        sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(args.steps):
            metrics = worker.train_step(batch)
        sync()
        seconds = (time.perf_counter() - start) / args.steps
        worker.shutdown()
    tokens_per_s = rows * length / seconds
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak_tflops = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    mfu = tokens_per_s * flops_per_token(config, length) / (peak_tflops * 1e12) if peak_tflops else None
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    result = {
        "device": name,
        "shape": "tiny" if args.tiny else "Qwen3-0.6B",
        "length": length,
        "micro_batches": rows,
        "seconds_per_step": round(seconds, 3),
        "tokens_per_s": round(tokens_per_s),
        "mfu": round(mfu, 4) if mfu is not None else None,
        "peak_allocated_gib": round(peak_gib, 2) if peak_gib is not None else None,
        "loss": metrics["loss"],
    }
    memory = result["peak_allocated_gib"]
    print(f"{name}: {result['tokens_per_s']} tokens/s, MFU {result['mfu']}, peak {memory} GiB")
    print("prime-rl, one H100 (their BENCHMARKS.md): 11.9k tokens/s, 11.1% MFU, 12.5 GiB")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
