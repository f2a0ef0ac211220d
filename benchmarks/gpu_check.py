"""GPU check: ROLL's CUDA paths on one device, measured, without Ray.

Builds a Qwen2-shaped random model with ``roll.models.tiny.build_tiny_model`` (default: Qwen2-0.5B's
shape, hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864, tied 151,936-token vocabulary: 494M
parameters), saves it in Hugging Face format, then runs each section in a fresh child process (clean
peak-memory numbers; a CUDA error or a hang in one section cannot take the others down):

- ``infer``: ``HFEngine`` (what rollout workers run) decoding ``--new-tokens`` tokens per row at each of
  ``--batch-sizes`` (EOS disabled so every row decodes the full length; random prompts of
  ``--prompt-len``), tokens/s and peak memory; then the engine's ``release_memory`` /
  ``reacquire_memory`` (what colocation calls), bytes, seconds and device memory before/after.
- ``train``: a real ``ActorWorker`` (in-process, no Ray): ``setup`` then ``train_step`` (PPO-clip policy
  loss with entropy, fused AdamW, grad clip) on ``--train-rows`` rows of ``--prompt-len`` +
  ``--response-len`` tokens (responses of ragged lengths, a quarter to all of ``--response-len``, as RL
  batches are) in micro-batches of ``--micro-batch``; step time, tokens/s of real tokens, MFU against
  ``--peak-tflops``, peak memory; then ``offload_states`` / ``reload_states`` (model + grads + Adam
  moments, through reused pinned buffers) twice, a step after each reload. Also reports the share of
  weights one step at lr 1e-6 changes. Each of ``--train-variants`` runs: an attention kernel
  (``sdpa_varlen`` and ``flash_attention_2`` pack the rows without padding, and report how far the packed
  logprobs are from sdpa's padded ones; flash_attention_2 is skipped when flash-attn is not installed), with
  ``+ckpt`` gradient checkpointing. ``--dtypes bf16-autocast`` runs float32 weights under
  ``torch.autocast(bfloat16)`` instead (a peer's way of mixed precision, for comparison: ROLL's bfloat16
  is FSDP2's mixed precision over float32 master weights).
- ``sync``: the colocated weight transfer (``ActorWorker.send_weights`` -> ``RolloutWorker.receive_weights``
  over a two-rank gloo group through host memory, as ``WeightSync`` picks for roles sharing a GPU), in
  two threads of one process; checks the engine then holds the trainer's weights.
- ``nccl1`` (CUDA only): a one-rank NCCL weight group (``create_group`` + ``send_weights`` through a
  CUDA staging buffer), FSDP2 (``shard_model``) over a one-rank NCCL default group with a train step
  and a full state dict, and the trainer's CPU-tensor all-reduces on that NCCL group.
- ``nccl2`` (CUDA only): two ranks of a NCCL group on the same GPU (NCCL normally refuses this).
- ``decode`` (not in the default list): the model's own greedy decode loop, Hugging Face ``DynamicCache``
  against ROLL's ``SlotCache``, each shape sequence run twice (per-shape caches such as cuDNN attention
  plans show as a faster second run); ``--profile`` prints the top CPU ops; ``--no-cudnn-sdp`` turns off
  SDPA's cuDNN backend in every section.
- ``host_copy`` (not in the default list): 2 GiB device <-> host copies, pageable vs pinned.

    python benchmarks/gpu_check.py                               # 0.5B, fp32 and bf16, default sections
    python benchmarks/gpu_check.py --sections decode,host_copy --dtypes float32,bfloat16
    python benchmarks/gpu_check.py --sections train --dtypes bfloat16   # issue 41's numbers: MFU, packing
    python benchmarks/gpu_check.py --size tiny --vocab 0 --device cpu --new-tokens 8 --prompt-len 8 \
        --response-len 8 --train-rows 4 --micro-batch 2         # smoke check on a CPU (under a minute)

Prints one table per section; ``--json FILE`` also writes every result as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

SIZES = {
    # Qwen2-0.5B's shape (its vocabulary is 151,936 tokens).
    "0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
    ),
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
    ),
}
ALPHABET = "0123456789+-*=() "
RESULT = "RESULT "


# --------------------------------------------------------------------------------------------- helpers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _SizedVocab:
    """The char tokenizer's special ids with ``size`` as its length: ``build_tiny_model`` sizes the
    embedding by ``len(tokenizer)``, so this builds a model with a real-model vocabulary."""

    def __init__(self, tokenizer, size: int):
        self._tokenizer, self._size = tokenizer, size

    def __len__(self) -> int:
        return self._size

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def build_model(size: str, vocab: int | None, directory: Path) -> dict:
    """Build and save the model (fp32 safetensors + the char tokenizer); returns what was built."""
    from roll.config.common import TinyModelConfig
    from roll.models.tiny import build_tiny_model
    from roll.models.tokenizer import build_char_tokenizer

    cfg = TinyModelConfig(alphabet=ALPHABET, max_position_embeddings=4096, **SIZES[size])
    tokenizer = build_char_tokenizer(cfg.alphabet, model_max_length=cfg.max_position_embeddings)
    start = time.perf_counter()
    model = build_tiny_model(cfg, _SizedVocab(tokenizer, vocab or len(tokenizer)))
    built = time.perf_counter() - start
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    params = sum(p.numel() for p in model.parameters())
    return {
        "params": params,
        "vocab": model.config.vocab_size,
        "build_s": built,
        "save_s": time.perf_counter() - start - built,
    }


def _device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _mem(device) -> dict:
    """Allocator and whole-device memory in GiB (whole-device: every process, CUDA contexts included)."""
    import torch

    if device.type != "cuda":
        return {}
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    g = 2**30
    return {
        "alloc_gib": torch.cuda.memory_allocated() / g,
        "reserved_gib": torch.cuda.memory_reserved() / g,
        "device_used_gib": (total - free) / g,
    }


def _peak(device) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def _reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _emit(record: dict) -> None:
    print(RESULT + json.dumps(record), flush=True)


def _random_ids(rows: int, length: int, vocab: int, generator):
    import torch

    # Ids 6.. skip the char tokenizer's special tokens (pad, eos, unk, role markers).
    return torch.randint(6, vocab, (rows, length), generator=generator)


def _train_batch(rows: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0):
    """Full prompts and responses of ragged lengths (a quarter to all of ``response_len``), right-padded."""
    import torch

    from roll.data.batch import Batch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, response_len // 4), response_len + 1, (rows,), generator=g)
    response_mask = (torch.arange(response_len)[None] < lengths[:, None]).long()
    return Batch(
        tensors={
            "prompt_ids": _random_ids(rows, prompt_len, vocab, g),
            "prompt_mask": torch.ones(rows, prompt_len, dtype=torch.long),
            "response_ids": _random_ids(rows, response_len, vocab, g),
            "response_mask": response_mask,
            "advantages": torch.randn(rows, response_len, generator=g),
        }
    )


def _actor(args, dtype: str, attn_implementation: str = "sdpa", checkpointing: bool = False):
    from roll.workers.actor import ActorSpec, ActorWorker
    from roll.workers.base import ModelSpec
    from roll.workers.trainer import OptimizerSpec

    spec = ActorSpec(
        model=ModelSpec(path=args.model_dir, dtype=dtype, attn_implementation=attn_implementation),
        optimizer=OptimizerSpec(lr=1e-6, total_steps=1000),
        micro_batch_size=args.micro_batch,
        gradient_checkpointing=checkpointing,
    )
    worker = ActorWorker("actor", 0, 1, spec)
    worker.setup()
    return worker


# --------------------------------------------------------------------------------------------- sections
def section_infer(args, dtype: str) -> None:
    import torch

    from roll.models.loading import load_causal_lm
    from roll.strategies.infer.hf import HFEngine
    from roll.strategies.requests import GenerateRequest, SamplingParams

    device = _device(args.device)
    start = time.perf_counter()
    model = load_causal_lm(args.model_dir, dtype=dtype, device=device)
    load_s = time.perf_counter() - start
    vocab = model.config.vocab_size
    # EOS id -1 never matches a sampled token (the generation config's EOS goes too): every row decodes
    # exactly max_new_tokens.
    model.generation_config.eos_token_id = None
    engine = HFEngine(model, SimpleNamespace(eos_token_id=-1, pad_token_id=0), device)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)

    def run(rows: int, new_tokens: int, tag: str) -> tuple[float, int]:
        ids = _random_ids(rows, args.prompt_len, vocab, g).tolist()
        params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
        requests = [GenerateRequest(f"{tag}-{i}", ids[i], params) for i in range(rows)]
        _sync(device)
        t0 = time.perf_counter()
        engine.submit_many(requests)
        results = [engine.await_result(r.request_id, 600) for r in requests]
        _sync(device)
        return time.perf_counter() - t0, sum(len(r.token_ids) for r in results)

    try:
        for rows in args.batch_sizes:
            run(rows, 4, f"warm{rows}")  # warm-up: kernels, allocator, cuBLAS handles
            _reset_peak(device)
            seconds, tokens = run(rows, args.new_tokens, f"b{rows}")
            _emit(
                {
                    "section": "infer",
                    "dtype": dtype,
                    "rows": rows,
                    "prompt_len": args.prompt_len,
                    "new_tokens": args.new_tokens,
                    "tokens": tokens,
                    "seconds": seconds,
                    "tokens_per_s": tokens / seconds,
                    "ms_per_step": 1000 * seconds / args.new_tokens,
                    "peak_gib": _peak(device),
                    "load_s": load_s,
                }
            )
        if device.type == "cuda" and args.profile:  # every thread's ops, the serving thread's included
            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            ) as prof:
                run(args.batch_sizes[0], 16, "profiled")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        before = _mem(device)
        released = engine.release_memory()
        after = _mem(device)
        back = engine.reacquire_memory()
        seconds, tokens = run(args.batch_sizes[0], 4, "after-reacquire")
        _emit(
            {
                "section": "engine_offload",
                "dtype": dtype,
                "bytes": released["bytes"],
                "release_s": released["seconds"],
                "reacquire_bytes": back["bytes"],
                "reacquire_s": back["seconds"],
                "before": before,
                "released": after,
                "reacquired": _mem(device),
                "generates_after": tokens > 0,
            }
        )
    finally:
        engine.shutdown()


def section_train(args, dtype: str) -> None:
    """``dtype`` float32 / bfloat16 as ROLL loads them (bfloat16: FSDP2 mixed precision over float32
    master weights), or ``bf16-autocast``: float32 weights and Adam state with the forward and backward
    under ``torch.autocast(bfloat16)``, for comparison."""
    import torch

    from roll.strategies.hf_forward import packs_sequences

    device = _device(args.device)
    autocast = dtype == "bf16-autocast"
    kernel, _, extra = args.child_variant.partition("+")
    t0 = time.perf_counter()
    worker = _actor(args, "float32" if autocast else dtype, kernel, checkpointing=extra == "ckpt")
    if autocast:
        plain_step = worker.train_step

        def train_step(batch, *a, **k):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return plain_step(batch, *a, **k)

        worker.train_step = train_step
    setup_s = time.perf_counter() - t0
    assert worker.device.type == device.type, f"actor picked {worker.device}, expected {device}"
    vocab = worker.model.config.vocab_size
    batch = _train_batch(args.train_rows, args.prompt_len, args.response_len, vocab)
    tokens = int(batch["prompt_mask"].sum() + batch["response_mask"].sum())  # real tokens, not padding
    packed_vs_padded = None
    if packs_sequences(worker.model):
        # The packed kernel's logprobs against the same weights' padded sdpa pass.
        from roll.strategies.hf_forward import response_logprobs

        with torch.no_grad():
            packed, _ = response_logprobs(worker.model, batch.to(worker.device))
            kernel_name = worker.model.config._attn_implementation
            worker.model.config._attn_implementation = "sdpa"
            try:
                padded, _ = response_logprobs(worker.model, batch.to(worker.device))
            finally:
                worker.model.config._attn_implementation = kernel_name
        packed_vs_padded = float((packed - padded).abs().max())
    worker.train_step(batch)  # warm-up (and creates the Adam moments)

    # How much of the model one step at an RL learning rate (1e-6) changes: without an fp32 master copy,
    # bf16 weights drop updates below their rounding step.
    def local(t):  # a sharded (FSDP2) parameter's own shard: older torch has no DTensor `!=`
        return t.to_local() if hasattr(t, "to_local") else t

    before = [local(p.detach()).clone() for p in worker.model.parameters()]
    worker.train_step(batch)
    changed = sum(int((local(p.detach()) != b).sum()) for p, b in zip(worker.model.parameters(), before))
    changed_frac = changed / sum(b.numel() for b in before)
    del before
    if device.type == "cuda":
        torch.cuda.empty_cache()
    _reset_peak(device)
    times, metrics = [], {}
    for _ in range(args.train_steps):
        _sync(device)
        start = time.perf_counter()
        metrics = worker.train_step(batch)
        _sync(device)
        times.append(time.perf_counter() - start)
    times.sort()
    median = times[len(times) // 2]
    if args.profile:  # where a step's time goes: the top ops by their own CPU time and by device time
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            worker.train_step(batch)
            _sync(device)
        for key in ("self_cpu_time_total", "self_device_time_total" if device.type == "cuda" else None):
            if key:
                print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
    params = sum(p.numel() for p in worker.model.parameters())
    # Model FLOPs: 6 per parameter per token (forward and backward; the tied embedding counts once, for the
    # head), plus causal attention's 6 x layers x hidden x length^2 per sequence.
    cfg = worker.model.config
    lengths = batch["prompt_mask"].sum(1) + batch["response_mask"].sum(1)
    attention = 6 * cfg.num_hidden_layers * cfg.hidden_size * int((lengths.double() ** 2).sum())
    model_flops = 6 * params * tokens + attention
    param_dtypes = sorted({str(p.dtype) for p in worker.model.parameters()})
    state_dtypes = sorted({f"{k}:{v.dtype}" for s in worker.optimizer.state.values() for k, v in s.items()})
    _emit(
        {
            "section": "train",
            "dtype": dtype,
            "variant": args.child_variant,
            "packed": packs_sequences(worker.model),
            "params": params,
            "rows": args.train_rows,
            "seq_len": args.prompt_len + args.response_len,
            "micro_batch": args.micro_batch,
            "step_s_median": median,
            "step_s_all": times,
            "tokens_per_s": tokens / median,
            "mfu": model_flops / median / (args.peak_tflops * 1e12),
            "peak_gib": _peak(device),
            "setup_s": setup_s,
            "loss": metrics.get("loss"),
            "grad_norm": metrics.get("grad_norm"),
            "changed_frac_lr1e-6": changed_frac,
            "packed_vs_padded_logprob_maxdiff": packed_vs_padded,
            "param_dtypes": param_dtypes,
            "state_dtypes": state_dtypes,
        }
    )

    def where() -> list[str]:
        return sorted(
            {str(t.device) for s in worker.optimizer.state.values() for t in s.values()}
            | {str(p.device) for p in worker.model.parameters()}
        )

    # Two rounds, as a colocated run does every step: anything allocated once (host buffers) shows.
    for round_ in (1, 2):
        before = _mem(device)
        off = worker.offload_states()
        offloaded, where_off = _mem(device), where()
        on = worker.reload_states()
        reloaded, where_on = _mem(device), where()
        start = time.perf_counter()
        after_metrics = worker.train_step(batch)
        _sync(device)
        _emit(
            {
                "section": "trainer_offload",
                "dtype": dtype,
                "variant": args.child_variant,
                "round": round_,
                "bytes": off["bytes"],
                "offload_s": off["seconds"],
                "reload_bytes": on["bytes"],
                "reload_s": on["seconds"],
                "offload_gb_per_s": off["bytes"] / max(off["seconds"], 1e-9) / 1e9,
                "reload_gb_per_s": on["bytes"] / max(on["seconds"], 1e-9) / 1e9,
                "before": before,
                "offloaded": offloaded,
                "reloaded": reloaded,
                "devices_when_offloaded": where_off,
                "devices_when_reloaded": where_on,
                "step_after_reload_s": time.perf_counter() - start,
                "loss_after_reload": after_metrics.get("loss"),
            }
        )


def section_sync(args, dtype: str) -> None:
    import torch

    from roll.distributed.collective import create_group, destroy_group
    from roll.workers.base import ModelSpec
    from roll.workers.rollout import RolloutSpec, RolloutWorker

    device = _device(args.device)
    actor = _actor(args, dtype)
    batch = _train_batch(4, 16, 16, actor.model.config.vocab_size)
    actor.train_step(batch)  # the weights now differ from the rollout's copy
    rollout = RolloutWorker("rollout", 0, 1, RolloutSpec(model=ModelSpec(path=args.model_dir, dtype=dtype)))
    rollout.setup()
    plan = actor.weight_plan(args.bucket_mb << 20)
    port = _free_port()
    groups: dict[int, object] = {}
    errors: list[str] = []

    def join(rank: int) -> None:
        try:
            groups[rank] = create_group("gpu-check", "gloo", "127.0.0.1", port, rank, 2, 120.0)
        except Exception:  # noqa: BLE001
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    actor.weight_group, rollout.weight_group = groups[0], groups[1]
    out: dict[str, dict] = {}
    for version in (1, 2):

        def receive(v=version) -> None:
            try:
                out["recv"] = rollout.receive_weights(plan, v, 120.0)
            except Exception:  # noqa: BLE001
                errors.append(traceback.format_exc())

        receiver = threading.Thread(target=receive)
        receiver.start()
        start = time.perf_counter()
        sent = actor.send_weights(plan, version, 120.0)
        receiver.join()
        seconds = time.perf_counter() - start
        if errors:
            raise RuntimeError("\n".join(errors))
        trained = dict(actor._named_weights())
        served = dict(rollout.engine._model.named_parameters())
        same = all(
            torch.equal(trained[name].detach().to(device), served[name].detach())
            for name in served
            if name in trained
        )
        _emit(
            {
                "section": "sync",
                "dtype": dtype,
                "version": version,
                "path": "gloo (colocated)",
                "bytes": sent["bytes"],
                "buckets": sent["buckets"],
                "seconds": seconds,
                "gb_per_s": sent["bytes"] / seconds / 1e9,
                "engine_matches_trainer": same,
                "engine_device": str(next(rollout.engine._model.parameters()).device),
            }
        )
    destroy_group(groups[0])
    destroy_group(groups[1])
    rollout.engine.shutdown()


def section_nccl1(args, dtype: str) -> None:
    """One-rank NCCL: the weight group's sender path and FSDP2 over NCCL; the trainer's CPU all-reduces."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from roll.distributed.collective import all_reduce_max, broadcast, create_group, destroy_group
    from roll.strategies.fsdp import full_state_dict, shard_model

    device = _device(args.device)
    results: dict[str, object] = {
        "section": "nccl1",
        "dtype": dtype,
        "nccl_version": ".".join(map(str, torch.cuda.nccl.version())),
    }

    def attempt(name: str, fn) -> None:
        start = time.perf_counter()
        try:
            value = fn()
            results[name] = {"ok": True, "seconds": time.perf_counter() - start, **(value or {})}
        except Exception as exc:  # noqa: BLE001 - recorded
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
            traceback.print_exc()

    actor = _actor(args, dtype)

    def weight_group() -> dict:
        group = create_group("gpu-check-nccl", "nccl", "127.0.0.1", _free_port(), 0, 1, 60.0)
        t = torch.arange(8, device=device)
        broadcast(group, t, 0, 60.0)
        flags = torch.zeros(1, dtype=torch.int64, device=device)
        all_reduce_max(group, flags, 60.0)
        actor.weight_group = group
        plan = actor.weight_plan(args.bucket_mb << 20)
        sent = actor.send_weights(plan, 1, 60.0)  # NCCL path: packs into a CUDA staging buffer
        destroy_group(group)
        actor.weight_group = None
        return {"bytes": sent["bytes"], "buckets": sent["buckets"], "send_s": sent["seconds"]}

    attempt("weight_group_1rank", weight_group)

    def default_group() -> dict:
        dist.init_process_group(
            "nccl",
            init_method=f"tcp://127.0.0.1:{_free_port()}",
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=60),
        )
        return {"backend": str(dist.get_backend())}

    attempt("init_process_group_nccl", default_group)
    batch = _train_batch(args.train_rows, 32, 32, actor.model.config.vocab_size)

    def cpu_all_reduce() -> dict:
        # What TrainerWorker does with world_size > 1 (global_denominator, micro-batch count, loss terms,
        # finite-weights flag): an all-reduce of a CPU tensor on the default group, here NCCL.
        actor.world_size = 2
        try:
            return {"denominator": actor.global_denominator(batch, "token-mean")}
        finally:
            actor.world_size = 1

    attempt("trainer_cpu_all_reduce_on_nccl", cpu_all_reduce)

    def fsdp_step() -> dict:
        actor.model = shard_model(actor.model)
        actor.optimizer = torch.optim.AdamW(actor.model.parameters(), lr=1e-6, fused=False)
        actor.scheduler = torch.optim.lr_scheduler.LambdaLR(actor.optimizer, lambda _: 1.0)
        metrics = actor.train_step(batch)
        state = full_state_dict(actor.model)
        off = actor.offload_states()
        offloaded = _mem(device)
        on = actor.reload_states()
        metrics2 = actor.train_step(batch)
        return {
            "loss": metrics["loss"],
            "grad_norm": metrics["grad_norm"],
            "state_keys": len(state),
            "offload_bytes": off["bytes"],
            "offload_s": off["seconds"],
            "reload_s": on["seconds"],
            "offloaded": offloaded,
            "loss_after_reload": metrics2["loss"],
        }

    attempt("fsdp2_one_rank_step", fsdp_step)
    if dist.is_initialized():
        dist.destroy_process_group()

    def mixed_backend() -> dict:
        # The proposed fix: CPU tensors over gloo, CUDA tensors over NCCL, one default group.
        dist.init_process_group(
            "cpu:gloo,cuda:nccl",
            init_method=f"tcp://127.0.0.1:{_free_port()}",
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=60),
        )
        cpu = torch.tensor([3.0])
        dist.all_reduce(cpu)
        gpu = torch.tensor([3.0], device=device)
        dist.all_reduce(gpu)
        dist.destroy_process_group()
        return {"cpu": cpu.item(), "cuda": gpu.item()}

    attempt("cpu_gloo_cuda_nccl_all_reduce", mixed_backend)
    _emit(results)


def section_nccl2(args, dtype: str) -> None:
    """Two ranks of one NCCL group on the same GPU, in two threads (what a colocated NCCL sync would be)."""
    import torch

    from roll.distributed.collective import broadcast, create_group, destroy_group

    device = _device(args.device)
    port = _free_port()
    outcome: dict[int, str] = {}

    def rank(r: int) -> None:
        try:
            group = create_group("gpu-check-nccl2", "nccl", "127.0.0.1", port, r, 2, 30.0)
            t = torch.full((4,), float(r), device=device)
            broadcast(group, t, 0, 30.0)
            outcome[r] = f"ok, received {t.tolist()}"
            destroy_group(group)
        except Exception as exc:  # noqa: BLE001
            outcome[r] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    _emit(
        {
            "section": "nccl2",
            "dtype": dtype,
            "rank0": outcome.get(0, "no answer in 60 s"),
            "rank1": outcome.get(1, "no answer in 60 s"),
        }
    )


def section_decode(args, dtype: str) -> None:
    """The model's own decode step outside the engine: Hugging Face ``DynamicCache`` against ROLL's
    ``SlotCache``, greedy, to tell the engine's overhead from the model's; then a profile of the
    slot-cache decode (top CPU ops)."""
    import torch

    from roll.models.loading import load_causal_lm
    from roll.strategies.infer.kv_cache import SlotCache

    device = _device(args.device)
    model = load_causal_lm(args.model_dir, dtype=dtype, device=device).eval()
    attn = getattr(model.config, "_attn_implementation", None)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    steps = min(args.new_tokens, 64)

    @torch.no_grad()
    def decode(rows: int, cache_kind: str, n: int, profile: bool = False) -> float:
        from transformers import DynamicCache

        ids = _random_ids(rows, args.prompt_len, vocab, g).to(device)
        mask = torch.ones_like(ids)
        cache = SlotCache() if cache_kind == "slot" else DynamicCache()
        out = model(
            input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1
        )
        token = out.logits[:, -1].argmax(-1)
        position = args.prompt_len
        _sync(device)
        prof = None
        if profile:
            prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            )
            prof.__enter__()
        start = time.perf_counter()
        for _ in range(n):
            mask = torch.cat([mask, mask.new_ones((rows, 1))], dim=1)
            positions = torch.full((rows, 1), position, device=device)
            position += 1
            out = model(
                input_ids=token.unsqueeze(1),
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            token = out.logits[:, -1].argmax(-1)
            token.tolist()  # the engine reads every step's tokens on the host
        _sync(device)
        seconds = time.perf_counter() - start
        if prof is not None:
            prof.__exit__(None, None, None)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
        return 1000 * seconds / n

    for rows in (1, 64):
        for cache_kind in ("dynamic", "slot"):
            decode(rows, cache_kind, 4)  # warm-up
            ms = decode(rows, cache_kind, steps)
            # The same shapes again: anything cached per shape (cuDNN attention plans) is now warm.
            again = decode(rows, cache_kind, steps)
            _emit(
                {
                    "section": "decode",
                    "dtype": dtype,
                    "attn": attn,
                    "cudnn_sdp": torch.backends.cuda.cudnn_sdp_enabled(),
                    "rows": rows,
                    "cache": cache_kind,
                    "steps": steps,
                    "ms_per_step": ms,
                    "ms_per_step_same_shapes_again": again,
                    "tokens_per_s": rows * 1000 / ms,
                }
            )
    if device.type == "cuda" and args.profile:
        decode(1, "slot", 16, profile=True)


def section_host_copy(args, dtype: str) -> None:
    """Device <-> host copies of 2 GiB, the way offload does them and the alternatives."""
    import torch

    device = _device(args.device)
    n = (2 << 30) if device.type == "cuda" else (64 << 20)
    x = torch.empty(n, dtype=torch.uint8, device=device)
    x.fill_(1)
    g = n / 1e9

    def timed(name: str, fn) -> None:
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        seconds = time.perf_counter() - start
        _emit(
            {
                "section": "host_copy",
                "dtype": "-",
                "what": name,
                "gb": g,
                "seconds": seconds,
                "gb_per_s": g / seconds,
            }
        )

    keep = {}
    timed("to(cpu), fresh pageable (as model.to)", lambda: keep.update(a=x.to("cpu")))
    timed("to(cpu), fresh pageable, again", lambda: keep.update(a=x.to("cpu")))
    timed("to(cpu, non_blocking) (as optimizer state)", lambda: keep.update(b=x.to("cpu", non_blocking=True)))
    keep["b_pinned"] = bool(keep["b"].is_pinned()) if device.type == "cuda" else False
    pageable = torch.empty(n, dtype=torch.uint8)
    pageable.fill_(0)
    timed("copy_ into a reused pageable buffer", lambda: pageable.copy_(x))
    start = time.perf_counter()
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda")
    alloc_s = time.perf_counter() - start
    timed("copy_ into a reused pinned buffer", lambda: pinned.copy_(x, non_blocking=True))
    timed("host -> device from pageable", lambda: x.copy_(pageable))
    timed("host -> device from pinned", lambda: x.copy_(pinned, non_blocking=True))
    _emit(
        {
            "section": "host_copy",
            "dtype": "-",
            "what": "allocating the pinned buffer",
            "gb": g,
            "seconds": alloc_s,
            "non_blocking_to_cpu_is_pinned": keep["b_pinned"],
        }
    )


SECTIONS = {
    "infer": section_infer,
    "train": section_train,
    "sync": section_sync,
    "nccl1": section_nccl1,
    "nccl2": section_nccl2,
    "decode": section_decode,
    "host_copy": section_host_copy,
}
CUDA_ONLY = {"nccl1", "nccl2"}
ONE_DTYPE = {"nccl1": "bfloat16", "nccl2": "float32", "host_copy": "-"}


# --------------------------------------------------------------------------------------------- driver
def _run_child(args, section: str, dtype: str, timeout_s: float, variant: str) -> list[dict]:
    cmd = [sys.executable, "-u", __file__, "--child", section, "--child-dtype", dtype]
    cmd += ["--child-variant", variant, *args.passthrough]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    records = []
    try:
        for line in proc.stdout:
            if line.startswith(RESULT):
                records.append(json.loads(line[len(RESULT) :]))
            else:
                sys.stdout.write(f"  [{section}/{dtype}] {line}")
        proc.wait()
    finally:
        timer.cancel()
    if proc.returncode != 0:
        why = "killed after the timeout" if proc.returncode in (-9, 137) else f"exit {proc.returncode}"
        records.append({"section": section, "dtype": dtype, "failed": why})
    return records


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, dict):
        return " ".join(f"{k.replace('_gib', '')}={_fmt(v)}" for k, v in value.items())
    return str(value)


def _table(records: list[dict]) -> None:
    by_section: dict[str, list[dict]] = {}
    for record in records:
        by_section.setdefault(record["section"], []).append(record)
    for section, rows in by_section.items():
        keys: list[str] = []
        for row in rows:
            keys += [k for k in row if k not in keys and k != "section"]
        print(f"\n### {section}\n")
        if section == "nccl1":  # one record of nested attempts: one line per attempt
            for row in rows:
                for key, value in row.items():
                    if key != "section":
                        print(f"- {key}: {_fmt(value)}")
            continue
        print("| " + " | ".join(keys) + " |")
        print("|" + " --- |" * len(keys))
        for row in rows:
            print("| " + " | ".join(_fmt(row.get(k, "")) for k in keys) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    parser.add_argument("--vocab", type=int, default=151936, help="0: the char tokenizer's own (~23)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--sections", default="infer,train,sync,nccl1,nccl2")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batch-sizes", default="1,16,64,256")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--response-len", type=int, default=384)
    parser.add_argument("--train-rows", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--train-steps", type=int, default=3)
    parser.add_argument(
        "--train-variants",
        default="sdpa,sdpa+ckpt,sdpa_varlen,sdpa_varlen+ckpt,flash_attention_2",
        help="train: attention kernels, +ckpt for gradient checkpointing",
    )
    parser.add_argument(
        "--peak-tflops", type=float, default=989.0, help="for MFU: the device's dense bf16 peak (H100/H200)"
    )
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument(
        "--profile", action="store_true", help="decode, infer, train: also print a profile of a step"
    )
    parser.add_argument(
        "--no-cudnn-sdp", action="store_true", help="turn off the cuDNN attention backend of SDPA"
    )
    parser.add_argument("--section-timeout", type=float, default=240.0)
    parser.add_argument("--model-dir", default=None, help="where to build the model (kept), or reuse it from")
    parser.add_argument("--json", default=None, help="also write every result to this JSON-lines file")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-dtype", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-variant", default="sdpa", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    if args.child:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if args.no_cudnn_sdp:
            import torch

            torch.backends.cuda.enable_cudnn_sdp(False)
        SECTIONS[args.child](args, args.child_dtype)
        return

    import torch

    from roll.models.loading import attention_problem

    device = _device(args.device)
    info = {"torch": torch.__version__, "device": str(device), "threads": torch.get_num_threads()}
    if device.type == "cuda":
        info.update(
            gpu=torch.cuda.get_device_name(),
            cuda=torch.version.cuda,
            nccl=".".join(map(str, torch.cuda.nccl.version())),
        )
    print("gpu_check:", json.dumps(info), flush=True)
    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        model_dir = args.model_dir or str(Path(tmp) / "model")
        if not (Path(model_dir) / "config.json").is_file():  # a given --model-dir is built once and kept
            built = build_model(args.size, args.vocab or None, Path(model_dir))
            records.append({"section": "model", "size": args.size, **built})
            print(
                f"built {built['params'] / 1e6:.1f}M parameters, vocab {built['vocab']} "
                f"({built['build_s']:.1f} s, saved in {built['save_s']:.1f} s)",
                flush=True,
            )
        args.passthrough = [
            f"--device={args.device}",
            f"--batch-sizes={','.join(map(str, args.batch_sizes))}",
            f"--new-tokens={args.new_tokens}",
            f"--prompt-len={args.prompt_len}",
            f"--response-len={args.response_len}",
            f"--train-rows={args.train_rows}",
            f"--micro-batch={args.micro_batch}",
            f"--train-steps={args.train_steps}",
            f"--peak-tflops={args.peak_tflops}",
            f"--bucket-mb={args.bucket_mb}",
            f"--model-dir={model_dir}",
            *(["--profile"] if args.profile else []),
            *(["--no-cudnn-sdp"] if args.no_cudnn_sdp else []),
        ]
        for section in args.sections.split(","):
            if section in CUDA_ONLY and device.type != "cuda":
                print(f"skipping {section}: needs CUDA", flush=True)
                continue
            dtypes = [ONE_DTYPE[section]] if section in ONE_DTYPE else args.dtypes.split(",")
            variants = args.train_variants.split(",") if section == "train" else ["sdpa"]
            for dtype, variant in [(d, v) for d in dtypes for v in variants]:
                problem = attention_problem(variant.partition("+")[0], [dtype])
                if problem:
                    print(f"skipping {section} {dtype} {variant}: {problem}", flush=True)
                    continue
                print(f"== {section} {dtype} {variant}", flush=True)
                start = time.perf_counter()
                got = _run_child(args, section, dtype, args.section_timeout, variant)
                print(f"   ({time.perf_counter() - start:.1f} s)", flush=True)
                records += got
                if args.json:
                    with open(args.json, "a") as f:
                        for record in got:
                            f.write(json.dumps(record) + "\n")
    _table(records)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
