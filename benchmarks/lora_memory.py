"""What LoRA saves, computed from model shapes: trainable parameters, optimizer state, gradients, checkpoint
and weight-sync bytes, and the host memory an engine keeps for merging, full fine-tuning against LoRA.

Each model is built on the meta device from its config (shapes only, no weights, nothing downloaded) and
wrapped by ``roll.strategies.lora.apply_lora`` exactly as the actor wraps it; the bytes per sync are the
sizes of the tensors ``roll.strategies.lora.outgoing_weights`` would send (the ``adapter`` and ``merged``
payloads; ``full`` for full fine-tuning, the same bytes as ``merged``). Accounting follows this trainer:
torch AdamW keeps two moments in each trained parameter's dtype; peft keeps adapter weights in float32
even on a bf16 model, so an adapter parameter costs 4 (weight) + 4 (gradient) + 8 (moments) bytes. A
checkpoint holds the trained weights and their moments (``TrainerWorker.save_state``; with LoRA the
adapter only) plus the weights again in Hugging Face format (``<role>/hf``; with LoRA the adapter in peft
format). Activations are left out: they are the same for both.

Shapes: ``quickstart`` is examples/quickstart.yaml's tiny model (float32); Qwen2.5-0.5B and Qwen2.5-7B are
their published configs (bfloat16). Run from the repository root::

    python benchmarks/lora_memory.py [--rank 8] [--alpha 16] [--targets q_proj,k_proj,v_proj,o_proj]
"""

from __future__ import annotations

import argparse

import torch

from roll.strategies.lora import DEFAULT_TARGETS, LoraSpec, apply_lora, outgoing_weights

# Published configs (config.json on the Hub), the fields that set the shapes.
SHAPES = {
    "quickstart": dict(
        vocab_size=None, hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, dtype=torch.float32,
    ),
    "Qwen2.5-0.5B": dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True, dtype=torch.bfloat16,
    ),
    "Qwen2.5-7B": dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False, dtype=torch.bfloat16,
    ),
}  # fmt: skip


def meta_model(shape: dict) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    fields = {k: v for k, v in shape.items() if k != "dtype"}
    if fields["vocab_size"] is None:  # the quickstart's character tokenizer
        from roll.config.loader import load_config
        from roll.pipelines.preflight import load_run_tokenizer

        fields["vocab_size"] = len(load_run_tokenizer(load_config("examples/quickstart.yaml").model))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(Qwen2Config(**fields), dtype=shape["dtype"])


def nbytes(tensors: list) -> int:
    return sum(torch.Size(t.shape).numel() * t.dtype.itemsize for t in tensors)


def account(name: str, shape: dict, spec: LoraSpec) -> dict[str, dict[str, float]]:
    """Counts and bytes for full fine-tuning and for LoRA on the model ``shape`` describes."""
    full_model = meta_model(shape)
    weights = {id(p): p for p in full_model.parameters()}.values()
    total = sum(p.numel() for p in weights)
    full_bytes = nbytes(list(weights))
    full = {
        "trainable": total,
        "optimizer": 2 * full_bytes,
        "gradients": full_bytes,
        "checkpoint": 4 * full_bytes,
        "sync": nbytes(outgoing_weights(full_model, "full")),
        "engine_host": 0,
    }
    lora_model = apply_lora(meta_model(shape), spec, ".")
    adapter = [p for p in lora_model.parameters() if p.requires_grad]
    adapter_bytes = nbytes(adapter)
    adapted = [layer.base_layer.weight for _, layer in _layers(lora_model)]
    lora = {
        "trainable": sum(p.numel() for p in adapter),
        "optimizer": 2 * adapter_bytes,
        "gradients": adapter_bytes,
        "checkpoint": 4 * adapter_bytes,
        "sync": nbytes(outgoing_weights(lora_model, "adapter")),
        "sync_merged": nbytes(outgoing_weights(lora_model, "merged")),
        "engine_host": nbytes(adapted),
    }
    return {"total": {"params": total, "bytes": full_bytes}, "full": full, "lora": lora}


def _layers(model: torch.nn.Module) -> list:
    from roll.strategies.lora import lora_layers

    return lora_layers(model)


def human(value: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.0f} B"


def count(value: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.0f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS))
    args = parser.parse_args(argv)
    spec = LoraSpec(rank=args.rank, alpha=args.alpha, target_modules=tuple(args.targets.split(",")))
    print(f"LoRA rank {spec.rank} on {', '.join(spec.target_modules)}\n")
    print(
        "| model | params | trainable (full / LoRA) | optimizer state (full / LoRA) | gradients (full / "
        "LoRA) | checkpoint (full / LoRA) | bytes per sync (full or merged / adapter) | engine host copy |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, shape in SHAPES.items():
        r = account(name, shape, spec)
        full, lora = r["full"], r["lora"]
        share = lora["trainable"] / full["trainable"]
        print(
            f"| {name} ({str(shape['dtype']).removeprefix('torch.')}) | {count(r['total']['params'])} | "
            f"{count(full['trainable'])} / {count(lora['trainable'])} ({share:.2%}) | "
            f"{human(full['optimizer'])} / {human(lora['optimizer'])} | "
            f"{human(full['gradients'])} / {human(lora['gradients'])} | "
            f"{human(full['checkpoint'])} / {human(lora['checkpoint'])} | "
            f"{human(lora['sync_merged'])} / {human(lora['sync'])} | {human(lora['engine_host'])} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
