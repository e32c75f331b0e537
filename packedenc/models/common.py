"""Pieces every family shares: input checking for `encode` and random init from a spec tree."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from packedenc.checks import (
    check_cu_seqlens, check_ids, check_max_seqlen, check_positions, float_dtype, host_values,
)
from packedenc.errors import ConfigError, InputError, InputTypeError
from packedenc.packing import positions_from_cu_seqlens
from packedenc.pytree import ParamSpec, tree_map_specs


def prepare_inputs(
    ids: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int | None,
    positions: Tensor | None,
    vocab_size: int | None,
    validate: bool,
    need_positions: bool = True,
    *,
    max_positions: int | None = None,
    table: str = "the model's position table",
    compute_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, int, Tensor | None]:
    """Check an encode call's inputs once, at entry, and fill in what can be derived.

    Type/dtype/shape/device checks always run (metadata only). Value checks (range of ids and
    positions, monotone cu_seqlens, max_seqlen against the longest sequence) run when the tensors
    are on the CPU (free) or when `validate=True` (a device sync); the GPU hot loop never syncs
    unless asked. A missing `max_seqlen` costs one sync. Missing positions are derived only when
    `need_positions` (a model without absolute positions skips those ~8 small kernels).
    `max_positions` is the size of the model's position table (None: no table, e.g. RoPE), which
    bounds max_seqlen as well as the positions; `table` describes it in messages. With host values
    the returned max_seqlen is the true longest sequence (a looser bound would only make the
    reference ops allocate for it).
    """
    check_ids(ids, vocab_size, values=False)
    check_cu_seqlens(cu_seqlens, values=False)
    if cu_seqlens.device != ids.device:
        raise InputError(f"cu_seqlens is on {cu_seqlens.device} but ids on {ids.device}; move both")
    if not isinstance(validate, bool):
        raise InputTypeError(f"validate must be True or False, got {validate!r}")
    float_dtype(compute_dtype, "compute_dtype")
    # Under torch.compile the value checks would be data-dependent branches (graph breaks);
    # they already ran eagerly when the batch was packed, and validate=True still forces them.
    values = host_values(ids, validate)
    if values:
        check_ids(ids, vocab_size)
        check_cu_seqlens(cu_seqlens, ids.numel())
    check_max_seqlen(max_seqlen, cu_seqlens if values else None)
    if positions is not None:
        check_positions(positions, ids, max_positions, values=values)
    if cu_seqlens.dtype != torch.int32:
        cu_seqlens = cu_seqlens.to(torch.int32)
    if max_seqlen is None or values:
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())  # free on the CPU; one sync otherwise
        given, max_seqlen = max_seqlen, longest
    else:
        given = max_seqlen
    if max_positions is not None:  # by the caller's bound, so a GPU batch (unread) and a CPU one agree
        check_position_limit(longest if given is None else given, max_positions, table)
    if positions is None and need_positions:
        positions = positions_from_cu_seqlens(cu_seqlens, ids.numel())
    return ids, cu_seqlens, max_seqlen, positions


def check_position_limit(max_seqlen: int, limit: int, what: str) -> None:
    """Raise InputError when sequences may be longer than the model's position table. `max_seqlen`
    is a host int (an upper bound on the longest sequence), so this never syncs."""
    if max_seqlen > limit:
        raise InputError(
            f"max_seqlen={max_seqlen}, but {what} allows sequences of at most {limit} tokens; truncate or "
            "split longer sequences (packedenc.pack_texts truncates to the model limit), and pass a "
            f"max_seqlen of at most {limit}"
        )


def init_from_spec(spec: Any, std: float, generator: torch.Generator | None, dtype: torch.dtype) -> Any:
    """Materialise a `params_spec` tree: normal(0, std) weights, ones/zeros where the spec says."""

    def make(_: str, s: ParamSpec) -> Tensor:
        if s.init == "zeros":
            return torch.zeros(s.shape, dtype=dtype)
        if s.init == "ones":
            return torch.ones(s.shape, dtype=dtype)
        return (torch.randn(s.shape, generator=generator) * std).to(dtype)

    return tree_map_specs(make, spec)


def mix_seed(seed: int, *salt: int) -> int:
    """A deterministic 63-bit seed for one dropout site, from the step seed and (layer, site)."""
    h = seed & 0x7FFFFFFFFFFFFFFF
    for v in salt:
        h = (h * 0x9E3779B97F4A7C15 + (v + 0x632BE59BD9B4E019)) & 0x7FFFFFFFFFFFFFFF
    return h


def dropout(x: Tensor, p: float, seed: int | None, *salt: int) -> Tensor:
    """Inverted dropout with a mask drawn from its own generator seeded by `mix_seed(seed, *salt)`.

    Identity when `seed` is None or p == 0. Pure: the same (seed, salt) gives the same mask, which
    is what makes activation checkpointing and reruns reproducible.
    """
    if seed is None or p == 0.0:
        return x
    g = torch.Generator(device=x.device)
    g.manual_seed(mix_seed(seed, *salt))
    keep = torch.rand(x.shape, generator=g, device=x.device) >= p
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))


def attention_dropout(p: float, field: str, ops: Any, seed: int | None, layer: int,
                      op: str = "varlen_attention") -> dict[str, Any]:
    """Keyword arguments that turn on dropout of the attention probabilities, or {} when off.

    Only the reference attention (`op` names the Ops entry) takes a dropout mask; with another
    attention backend a training config that asks for it is an error that says how to proceed,
    never a silent no-dropout.
    """
    if seed is None or p == 0.0:
        return {}
    chosen = dict(ops.chosen)[op]
    if chosen != "reference":
        raise ConfigError(
            f"{field}={p} in training needs backend='reference' for attention (the {chosen} {op} kernel "
            f"takes no dropout mask); to train with the {chosen} kernel set it to 0: dataclasses.replace("
            f"params, config=dataclasses.replace(params.config, {field}=0.0))"
        )
    return {"dropout_p": p, "dropout_seed": mix_seed(seed, layer, 0)}
