"""Score mods: position biases (ALiBi, T5 buckets, Graphormer's spatial encoding), soft-capping
and a learnable per-head temperature."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ._registry import Instance, Variant
from .causal import causal_mask
from .documents import document_ids, generate_document_mask


def alibi_slopes(num_heads: int, device="cpu") -> torch.Tensor:
    """ALiBi's per-head slopes ``2^(-8 (h + 1) / H)`` (float32 ``[H]``)."""
    return torch.exp2(-8.0 * torch.arange(1, num_heads + 1, dtype=torch.float32, device=device) / num_heads)


def generate_alibi_bias(num_heads: int, device="cpu"):
    """ALiBi: add ``slope[h] * (kv_idx - q_idx)``, a linear penalty on distance with one slope per
    head (:func:`alibi_slopes`), in place of position embeddings; usually with a causal mask.

    Inputs: ``num_heads`` (int), ``device`` (where the captured slopes live: the query's).
    Source: "Train Short, Test Long: Attention with Linear Biases" (Press et al., ICLR 2022);
    BLOOM, MPT.

    Head 0 of 2 (slope 1/16) under a causal mask, 0 = most negative:

    >>> print(bias_picture(generate_alibi_bias(2), 8, 8, h=0, mask_mod=causal_mask))
    9-------
    89------
    689-----
    5689----
    45689---
    345689--
    1345689-
    01345689
    """
    slopes = alibi_slopes(num_heads, device)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    return alibi


def generate_tanh_softcap(cap: float):
    """Soft-capping: ``cap * tanh(score / cap)`` squashes scores smoothly into ``(-cap, cap)``, which
    keeps logits from growing without bound in training.

    Inputs: ``cap`` (float; Gemma 2 uses 50 for attention). Source: Gemma 2 (Gemma Team, 2024),
    Grok-1. The picture of a position-free mod is its values:

    >>> softcap = generate_tanh_softcap(20.0)
    >>> [round(softcap(torch.tensor(s), 0, 0, 0, 0).item(), 2) for s in (-100.0, -10.0, 0.0, 10.0, 100.0)]
    [-20.0, -9.24, 0.0, 9.24, 20.0]
    """

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    softcap.__name__ = f"softcap_{cap:g}"
    return softcap


def t5_bucket(relative, num_buckets: int, max_distance: int, bidirectional: bool):
    """T5's bucket of a relative position ``kv_idx - q_idx`` (an int tensor): exact buckets for
    small distances, logarithmically wider ones up to ``max_distance``, the last bucket beyond.
    Usable inside a mod (tensor ops only)."""
    if bidirectional:
        num_buckets //= 2
        offset = torch.where(relative > 0, num_buckets, 0)
        distance = relative.abs()
    else:
        offset = 0
        distance = (-relative).clamp_min(0)
    exact = num_buckets // 2
    # The logarithmic part, computed in float32 as T5 does; distance >= 1 keeps log() finite where
    # the result is not used.
    ratio = distance.clamp_min(1).to(torch.float32) / exact
    wide = exact + (torch.log(ratio) / math.log(max_distance / exact) * (num_buckets - exact)).to(torch.int32)
    wide = wide.clamp_max(num_buckets - 1)
    return offset + torch.where(distance < exact, distance, wide)


def generate_t5_bias(table: torch.Tensor, max_distance: int = 128, bidirectional: bool = False):
    """T5 relative position bias: a learnable scalar per (bucket of ``kv_idx - q_idx``, head),
    ``table[t5_bucket(kv_idx - q_idx), h]``, shared by all layers in T5.

    Inputs: ``table`` (float tensor ``[num_buckets, H]``, learnable: T5's
    ``relative_attention_bias`` embedding), ``max_distance`` (distances beyond it share the last
    bucket), ``bidirectional`` (True for the encoder: separate buckets for keys after the query).
    Source: T5 (Raffel et al., JMLR 2020), after Shaw et al. (2018).

    Which bucket each pair reads (decoder, 10 buckets, max_distance 16; table = bucket index, so
    the digits are the buckets: exact up to distance 4, then wider):

    >>> table = torch.arange(10.0).view(10, 1)
    >>> print(bias_picture(generate_t5_bias(table, max_distance=16), 16, 16, mask_mod=causal_mask))
    0---------------
    10--------------
    210-------------
    3210------------
    43210-----------
    543210----------
    5543210---------
    65543210--------
    765543210-------
    7765543210------
    77765543210-----
    877765543210----
    8877765543210---
    98877765543210--
    998877765543210-
    9998877765543210
    """
    num_buckets = table.shape[0]

    def t5_bias(score, b, h, q_idx, kv_idx):
        bucket = t5_bucket(kv_idx - q_idx, num_buckets, max_distance, bidirectional)
        return score + table[bucket, h]

    return t5_bias


def graph_distances(num_nodes: int, edges: torch.Tensor, max_distance: int) -> torch.Tensor:
    """Shortest-path lengths between all nodes of an undirected graph (int32 ``[N, N]``), clipped:
    pairs further than ``max_distance`` apart, or not connected, get ``max_distance + 1``.
    ``edges``: int ``[E, 2]``. Breadth-first from all nodes at once (matrix products; graphs here
    have tens to thousands of nodes, where a dense adjacency is cheap)."""
    index = torch.cat([edges, edges.flip(1)]).t().long()
    adjacency = torch.zeros(num_nodes, num_nodes)
    adjacency[index[0], index[1]] = 1.0
    distance = torch.full((num_nodes, num_nodes), max_distance + 1, dtype=torch.int32)
    reached = torch.eye(num_nodes, dtype=torch.bool)
    distance[reached] = 0
    for step in range(1, max_distance + 1):
        grown = (adjacency @ reached.float()) > 0
        distance[grown & ~reached] = step
        reached |= grown
    return distance


def generate_graphormer_bias(distance: torch.Tensor, table: torch.Tensor, nodes_per_graph: Optional[int] = None):
    """Graphormer's spatial encoding: the tokens are a graph's nodes, and a learnable scalar per
    (shortest-path distance, head) is added: ``table[distance[q_idx, kv_idx], h]``.

    Inputs: ``distance`` (int tensor ``[N, N]``, captured: the clipped shortest-path lengths,
    e.g. from :func:`graph_distances`), ``table`` (float ``[max_distance + 2, H]``, learnable).
    One graph: Q_LEN == KV_LEN == N. For many small graphs packed in one sequence (molecules),
    pass ``nodes_per_graph = n`` and ``distance`` as ``[N, n]``: row i holds node i's distances to
    the nodes of its own graph (graph g holds nodes ``g n .. g n + n - 1``), the bias reads
    ``distance[q_idx, kv_idx % n]``, and a mask must keep pairs inside one graph
    (:func:`generate_document_mask` with ``inner=None``). Source: "Do Transformers Really Perform Bad for Graph
    Representation?" (Graphormer, Ying et al., NeurIPS 2021).

    A path 0-1-2-3-4-5 with a chord 0-5, distances clipped at 2 (table = distance):

    >>> distance = graph_distances(6, torch.tensor([[0, 1], [1, 2], [2, 3], [3, 4], [4, 5], [0, 5]]), 2)
    >>> print(bias_picture(generate_graphormer_bias(distance, torch.arange(4.0).view(4, 1)), 6, 6))
    036963
    303696
    630369
    963036
    696303
    369630
    """

    if nodes_per_graph is None:
        def graphormer(score, b, h, q_idx, kv_idx):
            return score + table[distance[q_idx, kv_idx], h]
    else:
        def graphormer(score, b, h, q_idx, kv_idx):
            return score + table[distance[q_idx, kv_idx % nodes_per_graph], h]

    return graphormer


def generate_head_temperature(temperature: torch.Tensor):
    """A learnable temperature per head: ``score / temperature[h]`` (sharper attention below 1,
    flatter above), trained with the model instead of the fixed ``1/sqrt(d)`` alone.

    Inputs: ``temperature`` (float tensor ``[H]``, learnable, positive). Source: learnable
    softmax temperature / scale, e.g. "Query-Key Normalization for Transformers" (Henry et al.,
    2020) and per-head scaling in several vision transformers (CaiT, Touvron et al., 2021).
    The picture of a position-free mod is its values:

    >>> temperature = torch.tensor([0.5, 2.0])
    >>> [generate_head_temperature(temperature)(torch.tensor(3.0), 0, h, 0, 0).item() for h in (0, 1)]
    [6.0, 1.5]
    """

    def head_temperature(score, b, h, q_idx, kv_idx):
        return score / temperature[h]

    return head_temperature


def _alibi(B, H, Q, KV, device):
    return Instance(generate_alibi_bias(H, device), causal_mask)


def _softcap(B, H, Q, KV, device):
    return Instance(generate_tanh_softcap(20.0), None)


def _t5(B, H, Q, KV, device):
    # 32 buckets and max distance 128, as T5; small random initial values (a model in training).
    table = (0.5 * torch.randn(32, H, device=device)).requires_grad_()
    return Instance(generate_t5_bias(table, max_distance=128), causal_mask, learnable=(table,))


def _graphormer(B, H, Q, KV, device):
    # Molecule-sized graphs of 64 nodes (the last one smaller) packed in the sequence, each a ring
    # with a random chord from every node; distances clipped at 8. Memory stays O(KV * 64).
    per_graph, max_distance = 64, 8
    gen = torch.Generator().manual_seed(3)
    distance = torch.full((KV, per_graph), max_distance + 1, dtype=torch.int32)
    for start in range(0, KV, per_graph):
        n = min(per_graph, KV - start)
        nodes = torch.arange(n)
        edges = torch.cat([torch.stack([nodes, (nodes + 1) % n], 1),
                           torch.stack([nodes, torch.randint(0, n, (n,), generator=gen)], 1)])
        distance[start:start + n, :n] = graph_distances(n, edges, max_distance)
    graph = document_ids([min(per_graph, KV - s) for s in range(0, KV, per_graph)], device)
    table = torch.randn(max_distance + 2, H, device=device).requires_grad_()
    score_mod = generate_graphormer_bias(distance.to(device), table, nodes_per_graph=per_graph)
    return Instance(score_mod, generate_document_mask(graph, inner=None), learnable=(table,))


def _temperature(B, H, Q, KV, device):
    temperature = torch.linspace(0.5, 2.0, H, device=device).requires_grad_()
    return Instance(generate_head_temperature(temperature), causal_mask, learnable=(temperature,))


VARIANTS = [
    Variant("alibi", _alibi, "causal, plus a per-head linear distance bias (ALiBi)", family="both", paper=True,
            tags=frozenset({"causal", "bias"}), factories=(generate_alibi_bias, alibi_slopes)),
    Variant("softcap", _softcap, "scores squashed by 20 * tanh(score / 20) (Gemma 2)", family="score", paper=True,
            decode=True, tags=frozenset({"bidirectional", "softcap"}), factories=(generate_tanh_softcap,)),
    Variant("t5_bias", _t5, "causal, plus a learnable T5 bias over 32 relative-position buckets", family="both",
            tags=frozenset({"causal", "bias", "learnable"}), factories=(generate_t5_bias, t5_bucket)),
    Variant("graphormer", _graphormer,
            "graphs of 64 nodes packed (rings with chords); learnable bias per shortest-path distance and head",
            family="both", square_only=True, decode=False, tags=frozenset({"graph", "bias", "learnable"}),
            factories=(generate_graphormer_bias, graph_distances, generate_document_mask)),
    Variant("head_temperature", _temperature, "causal, scores divided by a learnable per-head temperature",
            family="both", tags=frozenset({"causal", "learnable"}), factories=(generate_head_temperature,)),
]
