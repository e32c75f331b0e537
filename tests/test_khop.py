"""khop_sequences: hand-made graphs (ordering, truncation, isolated nodes, duplicate edges, self
loops, direction) and a per-anchor BFS oracle on random graphs, including the chunked path."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from packedenc.errors import InputError
from packedenc.models.graph_transformer import khop_sequences


def seqs(r):
    """KhopSequences -> list of [(node, hop), ...] per anchor."""
    out = []
    for s in range(r.cu_seqlens.numel() - 1):
        a, b = int(r.cu_seqlens[s]), int(r.cu_seqlens[s + 1])
        out.append(list(zip(r.index[a:b].tolist(), r.hops[a:b].tolist())))
    return out


def bfs_oracle(anchors, edges, num_hops, L, direction="out"):
    adj: dict[int, set[int]] = {}
    for s, d in edges:
        if direction == "in":
            s, d = d, s
        adj.setdefault(s, set()).add(d)
    out = []
    for a in anchors:
        dist = {a: 0}
        q = deque([a])
        while q:
            u = q.popleft()
            if dist[u] == num_hops:
                continue
            for v in adj.get(u, ()):
                if v not in dist:
                    dist[v] = dist[u] + 1
                    q.append(v)
        out.append(sorted(((v, h) for v, h in dist.items()), key=lambda p: (p[1], p[0]))[:L])
    return out


# 0 -> 1, 0 -> 5, 1 -> 2, 5 -> 2, 2 -> 3, 3 -> 0 (cycle back to the anchor), 4 isolated,
# a duplicated edge (0 -> 1 twice) and two self loops (1 -> 1, 0 -> 0)
EDGES = [(0, 5), (0, 1), (1, 2), (5, 2), (2, 3), (3, 0), (0, 1), (1, 1), (0, 0)]
EI = torch.tensor(EDGES).T


def test_order_is_hop_then_node_id():
    r = khop_sequences(torch.tensor([0]), EI, 3, 16)
    # hop 1: {1, 5} by id, hop 2: {2} (reached twice), hop 3: {3}; the cycle back to 0 is not a token
    assert seqs(r) == [[(0, 0), (1, 1), (5, 1), (2, 2), (3, 3)]]
    assert r.cu_seqlens.dtype == torch.int32 and r.index.dtype == torch.int64 and r.max_seqlen == 5


def test_truncation_keeps_nearest_hops_then_smallest_ids():
    # anchor 0 with 1-hop {9, 4, 7} and 2-hop {1, 2} (through 9): truncation to 3 keeps 0, 4, 7
    ei = torch.tensor([[0, 0, 0, 9, 9], [9, 4, 7, 1, 2]])
    assert seqs(khop_sequences(torch.tensor([0]), ei, 2, 3)) == [[(0, 0), (4, 1), (7, 1)]]
    assert seqs(khop_sequences(torch.tensor([0]), ei, 2, 5)) == [[(0, 0), (4, 1), (7, 1), (9, 1), (1, 2)]]
    assert seqs(khop_sequences(torch.tensor([0]), ei, 2, 1)) == [[(0, 0)]]


def test_isolated_repeated_anchors_duplicates_self_loops():
    r = khop_sequences(torch.tensor([4, 0, 4, 1]), EI, 1, 8)
    # node 4 has no edges: its sequence is itself; duplicate 0 -> 1 and self loops add nothing
    assert seqs(r) == [[(4, 0)], [(0, 0), (1, 1), (5, 1)], [(4, 0)], [(1, 0), (2, 1)]]
    assert r.cu_seqlens.tolist() == [0, 1, 4, 5, 7]


def test_zero_hops_and_direction_in():
    assert seqs(khop_sequences(torch.tensor([2, 3]), EI, 0, 8)) == [[(2, 0)], [(3, 0)]]
    # "in": follow edges backwards: 2 <- {1, 5} <- {0} (0 reaches 1 and 5)
    r = khop_sequences(torch.tensor([2]), EI, 2, 8, direction="in")
    assert seqs(r) == [[(2, 0), (1, 1), (5, 1), (0, 2)]]


def test_num_nodes_covers_ids_without_edges():
    r = khop_sequences(torch.tensor([7]), EI, 2, 4, num_nodes=8)
    assert seqs(r) == [[(7, 0)]]
    r = khop_sequences(torch.tensor([0, 1]), torch.empty(2, 0, dtype=torch.long), 2, 4)  # no edges at all
    assert seqs(r) == [[(0, 0)], [(1, 0)]]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget", [1, 7, 1 << 21])  # 1 and 7 force many chunks (one anchor each)
def test_random_graphs_match_bfs(seed, budget):
    g = torch.Generator().manual_seed(seed)
    N, E = 40, 90 + 30 * seed
    ei = torch.randint(0, N, (2, E), generator=g)
    anchors = torch.randint(0, N, (25,), generator=g)
    hops, L = 1 + seed % 3, [3, 6, 12, 40][seed]
    for direction in ("out", "in"):
        r = khop_sequences(anchors, ei, hops, L, num_nodes=N, direction=direction, pair_budget=budget)
        assert seqs(r) == bfs_oracle(anchors.tolist(), ei.T.tolist(), hops, L, direction)


def test_bad_input():
    with pytest.raises(InputError, match=r"edge_index must be a \(2, E\)"):
        khop_sequences(torch.tensor([0]), EI.T, 2, 4)
    with pytest.raises(InputError, match="anchors must be a 1-D integer"):
        khop_sequences(torch.tensor([0.0]), EI, 2, 4)
    with pytest.raises(InputError, match="anchors is empty"):
        khop_sequences(torch.tensor([], dtype=torch.long), EI, 2, 4)
    with pytest.raises(InputError, match=r"node ids must lie in \[0, num_nodes=4\)"):
        khop_sequences(torch.tensor([0]), EI, 2, 4, num_nodes=4)
    with pytest.raises(InputError, match="node ids must lie"):
        khop_sequences(torch.tensor([-1]), EI, 2, 4)
    with pytest.raises(InputError, match="max_seq_len must be >= 1"):
        khop_sequences(torch.tensor([0]), EI, 2, 0)
    with pytest.raises(InputError, match="num_hops must be >= 0"):
        khop_sequences(torch.tensor([0]), EI, -1, 4)
    with pytest.raises(InputError, match="direction must be"):
        khop_sequences(torch.tensor([0]), EI, 1, 4, direction="both")
