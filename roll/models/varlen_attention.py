"""``model.attn_implementation: sdpa_varlen``: padding-free attention over packed rows with torch alone.

transformers packs rows for FlashAttention only when the flash-attn package is installed (a CUDA build
that few pip installs can make). torch ships a varlen FlashAttention of its own
(``torch.nn.attention.varlen.varlen_attn``, CUDA, bfloat16/float16): this registers it with
transformers as ``sdpa_varlen``, so trainers pack micro-batches (``roll.strategies.hf_forward``) with no
extra package. Sequences in a pack are found where position ids restart at 0, as transformers' own
FlashAttention path finds them.

Where that kernel cannot run (a CPU, float32) each packed sequence goes through torch's
``scaled_dot_product_attention`` in turn: still no compute on padding and no mask as long as the pack.
Anything else (rows with padding, a KV cache: the rollout engine) is plain ``sdpa`` with sdpa's mask.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

NAME = "sdpa_varlen"
_HALF_DTYPES = (torch.bfloat16, torch.float16)


def sequence_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """Cumulative sequence offsets [N+1] (int32) of the packed sequences in one row of position ids:
    a sequence starts wherever the position is 0."""
    positions = position_ids.reshape(-1)
    starts = (positions == 0).nonzero().flatten()
    if starts.numel() == 0 or starts[0] != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    ends = starts.new_tensor([positions.numel()])
    return torch.cat([starts, ends]).to(torch.int32)


def has_sliding_window(config) -> bool:
    """Whether a model of ``config`` has sliding-window attention layers (e.g. Mistral's, or Qwen2's with
    ``use_sliding_window``): packing refuses them, since sdpa would attend across the packed sequences."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return "sliding_attention" in layer_types
    return getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)


def _packed(query: torch.Tensor, key: torch.Tensor, attention_mask, position_ids) -> bool:
    return (
        attention_mask is None
        and position_ids is not None
        and query.shape[0] == 1
        and query.shape[2] == key.shape[2]
    )


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``query`` [B, H, L, D] and ``key``/``value``
    [B, H_kv, L, D] in, [B, L, H, D] out. Causal attention within each packed sequence of a one-row
    batch (attention dropout, when training with it, through the per-sequence calls; sliding-window
    layers refused); anything else goes to ``sdpa``. With a ``sequence_shard`` keyword the batch is this
    rank's slice of the pack, and attention runs over the whole of it (sequence parallelism)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    shard = kwargs.pop("sequence_shard", None)
    if shard is not None:  # this rank holds a slice of the pack (``roll.strategies.sequence_parallel``)
        from roll.models.ulysses_attention import ulysses_attention

        options = dict(dropout=dropout, scaling=scaling, sliding_window=sliding_window, **kwargs)
        return ulysses_attention(varlen_attention_forward, module, query, key, value, shard, **options)
    position_ids = kwargs.get("position_ids")
    if not _packed(query, key, attention_mask, position_ids):
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            **kwargs,
        )
    if sliding_window:  # refused at load (``has_sliding_window``); never silently wrong
        raise ValueError(
            "model.attn_implementation=sdpa_varlen does not pack a model with sliding-window attention; "
            "use sdpa"
        )
    offsets = sequence_starts(position_ids)
    # [1, H, L, D] -> [L, H, D]: the varlen layout, every sequence's tokens one after another.
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    if q.is_cuda and q.dtype in _HALF_DTYPES and not dropout:
        longest = int((offsets[1:] - offsets[:-1]).max())
        out = _torch_varlen(q, k, v, offsets.to(q.device), longest, scaling)
    else:
        bounds = offsets.tolist()
        # [1, H, l, D] per sequence: with a batch dimension sdpa takes its fused (flash) kernel on a CPU
        # too; without one it falls back to the math path, which holds the [H, l, l] scores.
        out = torch.cat(
            [
                F.scaled_dot_product_attention(
                    q[None, start:end].transpose(1, 2),
                    k[None, start:end].transpose(1, 2),
                    v[None, start:end].transpose(1, 2),
                    dropout_p=dropout,
                    is_causal=True,
                    scale=scaling,
                    enable_gqa=k.shape[1] != q.shape[1],
                )[0].transpose(0, 1)
                for start, end in zip(bounds[:-1], bounds[1:])
            ]
        )
    return out[None], None


def _mask(batch_size: int, q_length: int, kv_length: int, *args, attention_mask=None, **kwargs):
    """No mask for one row of packed sequences without padding or past keys (the sequences are told
    apart by their position ids); sdpa's mask for anything else."""
    from transformers.masking_utils import sdpa_mask

    if batch_size == 1 and q_length == kv_length and (attention_mask is None or bool(attention_mask.all())):
        return None
    return sdpa_mask(batch_size, q_length, kv_length, *args, attention_mask=attention_mask, **kwargs)


@functools.cache
def _varlen_parameters() -> frozenset[str]:
    """The keyword names this torch's ``varlen_attn`` takes: read once, not on every attention call."""
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _torch_varlen(q, k, v, offsets, longest: int, scaling: float | None) -> torch.Tensor:
    """Causal ``varlen_attn`` over [T, H, D] tensors, across the torch releases that have it: 2.12 added
    grouped-query attention (older ones get the KV heads repeated) and 2.10 replaced ``is_causal`` by a
    window."""
    from torch.nn.attention.varlen import varlen_attn

    takes = _varlen_parameters()
    options = {"window_size": (-1, 0)} if "window_size" in takes else {"is_causal": True}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in takes:
            options["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    if "scale" in takes:
        options["scale"] = scaling
    elif scaling is not None:
        q = q * (scaling * q.shape[-1] ** 0.5)  # the kernel scales by 1/sqrt(D)
    return varlen_attn(q, k, v, offsets, offsets, longest, longest, **options)


def register() -> None:
    """Make ``sdpa_varlen`` an attention implementation that transformers loads models with."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(NAME, varlen_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, _mask)
