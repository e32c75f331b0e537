"""k-hop token sequences for the graph transformer, vectorised in plain torch (no torch_geometric).

For each anchor: the anchor, then the nodes within `num_hops` hops ordered by hop distance (BFS
shortest path), ties by ascending node id, truncated to `max_seq_len` tokens (anchor included).

This is a *static*, deterministic neighbourhood: hop-ordered like GiGL's opt-in
`prioritize_hop_order` (PR #759), not GiGL's default khop order (ascending node id regardless of
hop), and computed on whatever graph you pass (GiGL expands inside each batch's sampled subgraph;
pass that subgraph's edges to reproduce its neighbour sets).

Algorithm: a BFS run for all anchors at once over (anchor, node) pairs, one frontier per hop.
Pairs are encoded as int64 keys `anchor * N + node`, so `unique`/`isin` do the per-anchor
dedupe, the "not seen at a nearer hop" filter and the ordering by node id in one sort. Two
bounds keep the work near the output size: an anchor that is full stops expanding, and each
frontier node contributes at most `max_seq_len` of its (sorted) neighbours, which never changes
the result: the first `max_seq_len` entries of a row hold at least `max_seq_len - seen` unseen
nodes, all smaller than anything after them, so a truncated row only happens to anchors that
fill up at this hop. Frontiers larger than `pair_budget` candidates are processed in anchor
chunks.

Shapes: E edges, N nodes, S anchors (= sequences), T packed tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from packedenc.errors import InputError

__all__ = ["KhopSequences", "khop_sequences"]


class KhopSequences(NamedTuple):
    """Packed k-hop sequences. `index, cu_seqlens, hops = khop_sequences(...)` unpacks.

    Fields:
        index: (T,) int64 node id of every token; sequence s is index[cu_seqlens[s]:cu_seqlens[s+1]]
            and starts with its anchor.
        cu_seqlens: (S+1,) int32 boundaries.
        hops: (T,) int64 hop distance of every token from its anchor (anchor = 0).
    """

    index: Tensor
    cu_seqlens: Tensor
    hops: Tensor

    @property
    def max_seqlen(self) -> int:
        """Longest sequence (host int; syncs if the tensors live on a GPU)."""
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())


def _check(anchors: Tensor, edge_index: Tensor, num_hops: int, max_seq_len: int) -> None:
    if not isinstance(anchors, Tensor) or anchors.dim() != 1 or anchors.is_floating_point() \
            or anchors.dtype == torch.bool:
        raise InputError("anchors must be a 1-D integer tensor of node ids")
    if anchors.numel() == 0:
        raise InputError("anchors is empty: give at least one anchor node")
    if not isinstance(edge_index, Tensor) or edge_index.dim() != 2 or edge_index.shape[0] != 2 \
            or edge_index.is_floating_point() or edge_index.dtype == torch.bool:
        shape = tuple(edge_index.shape) if isinstance(edge_index, Tensor) else type(edge_index).__name__
        raise InputError(f"edge_index must be a (2, E) integer tensor (PyG layout: row 0 = source), got {shape}")
    if edge_index.device != anchors.device:
        raise InputError(f"edge_index is on {edge_index.device} but anchors on {anchors.device}")
    if num_hops < 0:
        raise InputError(f"num_hops must be >= 0, got {num_hops}")
    if max_seq_len < 1:
        raise InputError(f"max_seq_len must be >= 1 (the anchor itself), got {max_seq_len}")


def _csr(edge_index: Tensor, num_nodes: int, direction: str) -> tuple[Tensor, Tensor]:
    """(rowptr (N+1,), col (E',)): deduplicated, self loops dropped, each row sorted by node id."""
    src, dst = edge_index.long()
    if direction == "in":  # neighbours of u = sources of edges into u
        src, dst = dst, src
    keep = src != dst  # a self loop never changes a hop distance
    key = torch.unique(src[keep] * num_nodes + dst[keep])  # sorted: by source, then target
    src, col = key // num_nodes, key % num_nodes
    rowptr = torch.zeros(num_nodes + 1, dtype=torch.long, device=key.device)
    rowptr[1:] = torch.cumsum(torch.bincount(src, minlength=num_nodes), 0)
    return rowptr, col


def _expand(a_F: Tensor, v_F: Tensor, rowptr: Tensor, col: Tensor, cap: int, N: int) -> Tensor:
    """Keys anchor * N + neighbour for the frontier pairs (a_F, v_F), unsorted, with repeats."""
    start_F = rowptr[v_F]
    deg_F = (rowptr[v_F + 1] - start_F).clamp_max(cap)
    total = int(deg_F.sum())
    src_C = torch.repeat_interleave(torch.arange(a_F.numel(), device=a_F.device), deg_F, output_size=total)
    first_F = torch.cumsum(deg_F, 0) - deg_F
    edge_C = (start_F - first_F).index_select(0, src_C) + torch.arange(total, device=a_F.device)
    return (a_F * N).index_select(0, src_C) + col.index_select(0, edge_C)


def _new_sorted(seen_Z: list[Tensor], key_C: Tensor, base: int, small: bool) -> Tensor:
    """Sorted unique keys of key_C that are not in seen, with ONE sort.

    Seen keys enter as 2k and candidates as 2k+1, so after sorting each key's seen copy comes
    first; a candidate is new iff the element before it carries another key. Keys are taken
    relative to `base`; `small` means they fit in int32, whose sort is about 2x faster.
    """
    z = torch.cat([(s - base) * 2 for s in seen_Z] + [(key_C - base) * 2 + 1])
    z = torch.msort(z.int() if small else z).long()
    k = z >> 1
    new = (z & 1).bool()
    new[1:] &= k[1:] != k[:-1]
    return k[new] + base


def _rank_in_run(a: Tensor) -> Tensor:
    """Position of each element inside its run of equal values (a sorted)."""
    i = torch.arange(a.numel(), device=a.device)
    head = torch.ones_like(a, dtype=torch.bool)
    head[1:] = a[1:] != a[:-1]
    return i - torch.cummax(torch.where(head, i, torch.zeros_like(i)), 0).values


def _chunks(a_F: Tensor, deg_F: Tensor, budget: int, span: int) -> list[tuple[int, int]]:
    """Split the frontier (sorted by anchor) at anchor boundaries into chunks of at most `budget`
    expanded pairs and anchors spanning less than `span` (unless one anchor alone exceeds them)."""
    cum = torch.cumsum(deg_F, 0)
    F = a_F.numel()
    out, lo = [], 0
    while lo < F:
        base = int(cum[lo - 1]) if lo else 0
        hi = min(int(torch.searchsorted(cum, base + budget, right=True)),
                 int(torch.searchsorted(a_F, int(a_F[lo]) + span)))
        if hi < F:  # back off to the start of the anchor run that `hi` falls in
            hi = int(torch.searchsorted(a_F, a_F[hi]))
        if hi <= lo:  # a single anchor over budget: take its whole run
            hi = int(torch.searchsorted(a_F, a_F[lo], right=True))
        out.append((lo, hi))
        lo = hi
    return out


def khop_sequences(
    anchors: Tensor,
    edge_index: Tensor,
    num_hops: int,
    max_seq_len: int,
    *,
    num_nodes: int | None = None,
    direction: str = "out",
    pair_budget: int = 1 << 21,
) -> KhopSequences:
    """Packed per-anchor k-hop token sequences: anchor first, then by hop distance, then node id.

    Arguments:
        anchors: (S,) int node ids; a repeated anchor gets its own (identical) sequence.
        edge_index: (2, E) int, PyG layout (row 0 = source, row 1 = target). Duplicate edges and
            self loops are ignored.
        num_hops: how far to expand (0 = anchors alone).
        max_seq_len: tokens per sequence at most, the anchor included; the nearest hops are kept,
            and inside the hop that overflows, the smallest node ids.
        num_nodes: node count N (default: 1 + the largest id in anchors / edge_index).
        direction: "out" follows edges source -> target (GiGL's default); "in" follows them
            backwards (GiGL's `sampling_direction="in"`, for samplers whose edges point to the seed).
        pair_budget: candidate (anchor, neighbour) pairs expanded per chunk (memory bound).
    Return:
        `KhopSequences(index, cu_seqlens, hops)`; gather token features with `x[index]`.
    """
    _check(anchors, edge_index, num_hops, max_seq_len)
    if direction not in ("out", "in"):
        raise InputError(f"direction must be 'out' or 'in', got {direction!r}")
    device = anchors.device
    anchors = anchors.long()
    largest = int(anchors.max())
    if edge_index.numel():
        largest = max(largest, int(edge_index.max()))
    N = largest + 1 if num_nodes is None else int(num_nodes)
    low = min(int(anchors.min()), int(edge_index.min()) if edge_index.numel() else 0)
    if low < 0 or largest >= N:
        raise InputError(f"node ids must lie in [0, num_nodes={N}), got ids in [{low}, {largest}]")
    S, L = anchors.numel(), int(max_seq_len)
    rowptr, col = _csr(edge_index.to(device), N, direction)

    a_F = torch.arange(S, device=device)  # frontier pairs (anchor index, node), sorted by anchor
    v_F = anchors
    count_S = torch.ones(S, dtype=torch.long, device=device)
    seen = [a_F * N + v_F]  # kept keys, one sorted tensor per hop
    parts = [(a_F, torch.zeros_like(a_F), v_F)]  # (anchor, slot in its sequence, node) per hop
    for h in range(1, num_hops + 1):
        live = count_S.index_select(0, a_F) < L  # full anchors stop expanding
        a_F, v_F = a_F[live], v_F[live]
        if a_F.numel() == 0:
            break
        # Chunks of at most pair_budget candidates, whose relative keys fit in int32 when the
        # graph allows; an anchor never straddles two chunks, so everything stays per anchor.
        span = max(1, (1 << 30) // N)
        deg_F = (rowptr[v_F + 1] - rowptr[v_F]).clamp_max(L)
        kept = []
        for lo, hi in _chunks(a_F, deg_F, pair_budget, span):
            a_lo, a_hi = int(a_F[lo]), int(a_F[hi - 1]) + 1
            small = (a_hi - a_lo) * N < (1 << 30)
            seen_c = [p[torch.searchsorted(p, a_lo * N):torch.searchsorted(p, a_hi * N)] for p in seen]
            key_C = _new_sorted(seen_c, _expand(a_F[lo:hi], v_F[lo:hi], rowptr, col, L, N), a_lo * N, small)
            a_C = key_C // N
            rank_C = _rank_in_run(a_C)  # keys are sorted, so this ranks by node id
            keep = rank_C < (L - count_S).index_select(0, a_C)
            kept.append((a_C[keep], rank_C[keep], key_C[keep]))
        a_K = torch.cat([k[0] for k in kept])
        key_K = torch.cat([k[2] for k in kept])
        v_K = key_K - a_K * N
        parts.append((a_K, count_S.index_select(0, a_K) + torch.cat([k[1] for k in kept]), v_K))
        count_S = count_S + torch.bincount(a_K, minlength=S)
        seen.append(key_K)
        a_F, v_F = a_K, v_K

    cu = torch.zeros(S + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(count_S, 0)
    T = int(cu[-1])
    index = torch.empty(T, dtype=torch.long, device=device)
    hops = torch.empty(T, dtype=torch.long, device=device)
    for h, (a, slot, v) in enumerate(parts):  # scatter each hop's tokens to their final slots
        pos = cu[:-1].long().index_select(0, a) + slot
        index[pos] = v
        hops[pos] = h
    return KhopSequences(index, cu, hops)
