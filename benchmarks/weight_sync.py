"""Benchmark: trainer -> rollout weight sync (``roll.distributed.weight_sync.WeightSync``) by model size.

What is measured, per model size:

* a Qwen2 model (float32, tied embeddings, character tokenizer) is built locally with
  ``save_tiny_model`` into a temporary directory; nothing is downloaded;
* an actor Cluster of ``--trainer-ranks`` ``ActorWorker`` ranks (FSDP2 over gloo/NCCL when more than one,
  set up with ``setup_trainer``) and a rollout Cluster of ``--rollout-workers`` ``RolloutWorker`` ranks
  load it, and a ``WeightSync`` connects them (``--bucket-mb`` buckets);
* two ``WeightSync`` s on the same clusters: one left to pick its path (shared memory on one node,
  ``roll.distributed.shm_transfer``) and one forced onto the collective path (``transport="collective"``:
  gloo here). One warm-up sync each, then ``--repeats`` timed rounds, each syncing through shared
  memory and then through gloo (interleaved, so both see the same machine load), versions increasing
  across both. "s" is the median of the timed syncs as the controller sees them (``WeightSync.sync``:
  Ray calls, packing on the trainer, the transfer, loading into every rollout model, acknowledgement);
* in the same process, a plain memory copy of the same number of bytes: ``dst.copy_(src)`` between two
  preallocated float32 tensors (on the rollout workers' device), best of several.

How to read the table: "GB/s" is model bytes / sync time, and "memcpy GB/s" what one copy of the same bytes
achieves on this machine right now. "ratio" = sync time / memcpy time, i.e. how many plain copies of the
weights one sync costs; it compares across noisy or differently sized machines better than absolute
numbers do. The shared-memory path copies the bytes once into the segment and once out per receiver,
so with N receivers its floor is about 1 + N copies' worth of memory traffic (the receivers copy in
parallel, but on a small machine one copy can use up most of the memory bandwidth). gloo adds loopback
socket transfers (several kernel copies, the sender serving the receivers in turn). Small models
measure fixed latency (Ray calls, and for gloo the header, verdict and acknowledgement collectives), not
bandwidth. The warm-up syncs are slower: freshly loaded weights are memory-mapped from the checkpoint and
fault in on first use, and the segment's pages are first touched then; they are printed, not in the
median.

Run from the repository root::

    python benchmarks/weight_sync.py [--sizes tiny,10m,50m,300m] [--trainer-ranks 1] \
        [--rollout-workers 2] [--bucket-mb 256] [--repeats 3]

Ray starts locally with ``--num-cpus`` CPUs unless ``RAY_ADDRESS`` names a cluster to join.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import ray
import torch

from roll.config.common import RayConfig, TinyModelConfig
from roll.distributed.cluster import Cluster, wait_all
from roll.distributed.weight_sync import WeightSync
from roll.models.tiny import build_tiny_model, save_tiny_model
from roll.models.tokenizer import build_char_tokenizer
from roll.pipelines.common import init_ray, setup_trainer
from roll.workers.actor import ActorSpec, ActorWorker, OptimizerSpec
from roll.workers.base import ModelSpec
from roll.workers.rollout import RolloutWorker

# The character alphabet fixes a 23-token vocabulary, so size comes from width and depth alone.
SIZES: dict[str, TinyModelConfig] = {
    "tiny": TinyModelConfig(),
    "10m": TinyModelConfig(
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=1024,
    ),
    "50m": TinyModelConfig(
        hidden_size=640,
        num_hidden_layers=12,
        num_attention_heads=10,
        num_key_value_heads=2,
        intermediate_size=1792,
    ),
    "300m": TinyModelConfig(
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        intermediate_size=2816,
    ),
}
DEFAULT_SIZES = "tiny,10m,50m,300m"
GIB = 1 << 30


@dataclass
class SizeResult:
    name: str
    params: int
    nbytes: int
    buckets: int
    paths: dict[str, list[float]]  # path name ("shm", "gloo") -> timed sync seconds
    split: dict[str, float]  # shared memory: median write_s and read_s
    build_s: float
    setup_s: float
    memcpy_s: float
    peak_used_gib: float
    total_s: float

    def median_s(self, path: str) -> float:
        return statistics.median(self.paths[path])


class MemoryWatch:
    """Samples the node's used memory (total - available, all processes) in a thread; keeps the peak."""

    def __init__(self, interval_s: float = 0.05):
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, used_memory_bytes())
            self._stop.wait(self.interval_s)


def used_memory_bytes() -> int:
    """MemTotal - MemAvailable from /proc/meminfo (0 where there is none, e.g. macOS)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    except OSError:
        return 0
    kib = {key: int(value.split()[0]) for key, value in fields.items() if key in ("MemTotal", "MemAvailable")}
    return (kib.get("MemTotal", 0) - kib.get("MemAvailable", 0)) * 1024


def parameter_count(cfg: TinyModelConfig) -> int:
    """Distinct parameters of the model ``cfg`` builds (the tied head counted once), without allocating."""
    tokenizer = build_char_tokenizer(cfg.alphabet, model_max_length=cfg.max_position_embeddings)
    with torch.device("meta"):
        model = build_tiny_model(cfg, tokenizer)
    return sum(p.numel() for p in model.parameters())


def memcpy_seconds(nbytes: int, device: torch.device, min_tries: int = 5, min_total_s: float = 0.5) -> float:
    """Best time of ``dst.copy_(src)`` between two preallocated, touched float32 tensors of ``nbytes``.

    At least ``min_tries`` copies and at least ``min_total_s`` seconds of them (after one untimed copy), so
    that small copies are not judged by a single moment of contention with exiting workers."""
    numel = max(1, nbytes // 4)
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.zeros(numel, dtype=torch.float32, device=device)
    dst.copy_(src)
    best, tries, spent = float("inf"), 0, 0.0
    while tries < min_tries or (spent < min_total_s and tries < 10_000):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        best, tries, spent = min(best, elapsed), tries + 1, spent + elapsed
    del src, dst
    return best


def start_clusters(
    model_path: str, trainer_ranks: int, rollout_workers: int, timeout_s: float
) -> tuple[Cluster, Cluster]:
    """The actor and rollout clusters, set up in parallel (models loaded, FSDP formed when sharded)."""
    model = ModelSpec(path=model_path, dtype="float32")
    actor_spec = ActorSpec(model=model, optimizer=OptimizerSpec(lr=1e-5, total_steps=1))
    actor = Cluster("actor", ActorWorker, trainer_ranks, actor_spec, timeout_s=timeout_s)
    rollout = Cluster(
        "rollout",
        RolloutWorker,
        rollout_workers,
        # Rollout workers read only ``config.model``. A stdlib namespace rather than a class of this
        # script, so the workers can unpickle it even when the script is imported rather than run.
        SimpleNamespace(model=model),
        timeout_s=timeout_s,
    )
    try:
        wait_all(setup_trainer(actor, blocking=False), rollout.setup(blocking=False))
    except BaseException:
        kill_clusters(actor, rollout)
        raise
    return actor, rollout


def kill_clusters(*clusters: Cluster) -> None:
    for cluster in clusters:
        cluster.kill()


def bench_size(name: str, cfg: TinyModelConfig, args: argparse.Namespace) -> SizeResult:
    """Build, load, connect, warm up and time the syncs of one model size; then the memcpy baseline."""
    started = time.perf_counter()
    params = parameter_count(cfg)
    print(f"[{name}] {params / 1e6:.1f}M parameters: building the model ...", flush=True)
    with tempfile.TemporaryDirectory(prefix=f"roll-bench-{name}-") as tmp, MemoryWatch() as memory:
        path = str(save_tiny_model(cfg, Path(tmp) / "model"))
        gc.collect()
        build_s = time.perf_counter() - started
        print(f"[{name}] built in {build_s:.1f} s; starting the clusters ...", flush=True)
        setup_start = time.perf_counter()
        actor, rollout = start_clusters(path, args.trainer_ranks, args.rollout_workers, args.timeout_s)
        syncs: dict[str, WeightSync] = {}
        try:
            setup_s = time.perf_counter() - setup_start
            syncs = {
                "auto": WeightSync(actor, rollout, args.bucket_mb << 20, args.timeout_s),
                "gloo": WeightSync(
                    actor, rollout, args.bucket_mb << 20, args.timeout_s, transport="collective"
                ),
            }
            for sync in syncs.values():
                sync.connect()
            device = torch.device(rollout.device_type()[0])
            print(f"[{name}] clusters up in {setup_s:.1f} s; warm-up syncs ...", flush=True)
            versions = iter(range(1, 1_000_000))
            warm = {key: sync.sync(version=next(versions)) for key, sync in syncs.items()}
            timed: dict[str, list[dict]] = {key: [] for key in syncs}
            for _ in range(args.repeats):
                for key, sync in syncs.items():
                    timed[key].append(sync.sync(version=next(versions)))
            for key, sync in syncs.items():
                print(
                    f"[{name}] {sync.path_name} ({sync.reason}): warm-up {warm[key]['seconds']:.2f} s, "
                    "timed " + ", ".join(f"{t['seconds']:.3f}" for t in timed[key]) + " s",
                    flush=True,
                )
        finally:
            for sync in syncs.values():
                sync.close()
            kill_clusters(rollout, actor)
        gc.collect()
        # After the workers are gone, so the baseline neither competes with them for cores nor memory.
        if device.type == "cuda" and not torch.cuda.is_available():
            device = torch.device("cpu")  # the driver has no GPU of its own: compare with host memory
        nbytes = int(warm["gloo"]["bytes"])
        memcpy_s = memcpy_seconds(nbytes, device)
        gc.collect()
    auto = timed["auto"]
    split = {k: statistics.median(t[k] for t in auto) for k in ("write_s", "read_s") if k in auto[0]}
    return SizeResult(
        name=name,
        params=params,
        nbytes=nbytes,
        buckets=int(warm["gloo"]["buckets"]),
        paths={syncs[key].path_name: [t["seconds"] for t in runs] for key, runs in timed.items()},
        split=split,
        build_s=build_s,
        setup_s=setup_s,
        memcpy_s=memcpy_s,
        peak_used_gib=memory.peak_bytes / GIB,
        total_s=time.perf_counter() - started,
    )


COLUMNS = (
    ("size", 6),
    ("params", 8),
    ("MB", 8),
    ("buckets", 7),
    ("memcpy GB/s", 11),
    ("path", 5),
    ("sync s", 8),
    ("GB/s", 6),
    ("ratio", 6),
    ("write s", 7),
    ("read s", 7),
    ("peak GiB", 8),
    ("total s", 7),
)


def format_row(values: list[str]) -> str:
    return "  ".join(value.rjust(width) for value, (_, width) in zip(values, COLUMNS))


def result_rows(r: SizeResult) -> list[str]:
    """One row per path, the shared columns (size, bytes, memcpy) repeated so each row reads alone."""
    rows = []
    for path in r.paths:
        seconds = r.median_s(path)
        split = r.split if path == "shm" else {}
        rows.append(
            format_row(
                [
                    r.name,
                    f"{r.params / 1e6:.1f}M",
                    f"{r.nbytes / 1e6:.1f}",
                    str(r.buckets),
                    f"{r.nbytes / r.memcpy_s / 1e9:.2f}",
                    path,
                    f"{seconds:.3f}",
                    f"{r.nbytes / seconds / 1e9:.2f}",
                    f"{seconds / r.memcpy_s:.1f}",
                    f"{split['write_s']:.3f}" if split else "-",
                    f"{split['read_s']:.3f}" if split else "-",
                    f"{r.peak_used_gib:.1f}",
                    f"{r.total_s:.1f}",
                ]
            )
        )
    return rows


def machine_line(num_cpus: int | None) -> str:
    """CPU count, torch/Ray versions and the collective backend WeightSync would pick here."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    ray_cpus = ray.cluster_resources().get("CPU", 0)
    joined = os.environ.get("RAY_ADDRESS")
    where = f"joined {joined}" if joined else f"local, num_cpus={num_cpus}"
    return (
        f"machine: {platform.machine()} {os.cpu_count()} CPUs, {used_memory_bytes() / GIB:.1f} GiB in use; "
        f"python {platform.python_version()}, torch {torch.__version__}, ray {ray.__version__}; "
        f"Ray {where} ({ray_cpus:g} CPUs); backend {backend} "
        f"({'CUDA' if torch.cuda.is_available() else 'CPU only'})"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", default=DEFAULT_SIZES, help=f"Comma-separated, from {', '.join(SIZES)} (default: all)."
    )
    parser.add_argument("--trainer-ranks", type=int, default=1, help="ActorWorker ranks (>1: FSDP2).")
    parser.add_argument("--rollout-workers", type=int, default=2, help="RolloutWorker ranks (receivers).")
    parser.add_argument("--bucket-mb", type=int, default=256, help="Weight-transfer bucket size in MiB.")
    parser.add_argument("--repeats", type=int, default=3, help="Timed syncs per size (after one warm-up).")
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs of a locally started Ray.")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="Timeout of each call and transfer.")
    args = parser.parse_args(argv)
    names = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in names if s not in SIZES]
    if unknown or not names:
        parser.error(f"unknown size(s) {unknown or args.sizes!r}; choose from {', '.join(SIZES)}")
    for flag in ("trainer_ranks", "rollout_workers", "bucket_mb", "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    args.size_names = names
    return args


def main(argv: list[str] | None = None) -> int:
    from transformers.utils import logging as hf_logging

    args = parse_args(argv)
    started = time.perf_counter()
    hf_logging.disable_progress_bar()  # one "writing shards" bar per size would break up the log
    init_ray(RayConfig(num_cpus=args.num_cpus))
    print(machine_line(args.num_cpus))
    print(
        f"trainer ranks {args.trainer_ranks}, rollout workers {args.rollout_workers}, "
        f"bucket {args.bucket_mb} MiB, fp32, 1 warm-up + {args.repeats} timed syncs per size "
        "(sync s = median)",
        flush=True,
    )
    results = []
    try:
        for name in args.size_names:
            results.append(bench_size(name, SIZES[name], args))
    finally:
        if results:
            print()
            print(format_row([title for title, _ in COLUMNS]))
            for result in results:
                print("\n".join(result_rows(result)))
            print(
                "ratio = sync time / memcpy time of the same bytes; write s / read s = the shared-memory "
                "sync's trainer write and receivers' load (medians); peak GiB = node memory in use (all "
                "processes) at its highest during that size"
            )
        print(f"total wall time {time.perf_counter() - started:.1f} s", flush=True)
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
