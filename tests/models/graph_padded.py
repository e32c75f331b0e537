"""A straightforward padded graph transformer (test oracle), laid out like GiGL's nn.Module.

Written for the tests from the semantics of GiGL's `GraphTransformerEncoder` (v0.3.1): padded
(B, L, D) sequences, SDPA with an additive float mask (padded keys at finfo.min / 2 plus the
anchor-relative key bias), pre-norm layers that zero padded rows, the anchor-only last layer
(`query_seq_len=1`), final norm, readout, output projection, optional L2 normalisation. Its
submodule names are GiGL's, so `load_state_dict(to_gigl(params)[0])` (strict) checks the key map.

Shapes: B sequences, L padded length, D hidden, H heads, F input features.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from packedenc.models.graph_transformer import GraphTransformerConfig
from packedenc.models.graph_transformer.config import XGLU
from packedenc.packing import pad

_ACT = {"gelu": nn.GELU, "relu": nn.ReLU, "silu": nn.SiLU, "tanh": nn.Tanh}
_GLU_ACT = {"geglu": F.gelu, "swiglu": F.silu, "reglu": F.relu}


class FFN(nn.Module):
    def __init__(self, D: int, Fd: int, act: str):
        super().__init__()
        self.act = act
        if act in XGLU:
            self._linear_in = nn.Linear(D, 2 * Fd)
            self._linear_out = nn.Linear(Fd, D)
        else:
            self._ffn = nn.Sequential(nn.Linear(D, Fd), _ACT[act](), nn.Dropout(0.0), nn.Linear(Fd, D), nn.Dropout(0.0))

    def forward(self, x: Tensor) -> Tensor:
        if self.act in XGLU:
            gate, value = self._linear_in(x).chunk(2, dim=-1)
            return self._linear_out(_GLU_ACT[self.act](gate) * value)
        return self._ffn(x)


class Layer(nn.Module):
    def __init__(self, cfg: GraphTransformerConfig):
        super().__init__()
        D = cfg.hid_dim
        self.H, self.K = cfg.num_heads, cfg.head_dim
        self._attention_norm = nn.LayerNorm(D, eps=cfg.norm_eps)
        self._query_projection = nn.Linear(D, D)
        self._key_projection = nn.Linear(D, D)
        self._value_projection = nn.Linear(D, D)
        self._output_projection = nn.Linear(D, D)
        self._ffn_norm = nn.LayerNorm(D, eps=cfg.norm_eps)
        self._ffn = FFN(D, cfg.ffn_dim, cfg.activation)

    def forward(self, x: Tensor, bias: Tensor, valid: Tensor, q_len: int) -> Tensor:
        B, L, D = x.shape
        h = self._attention_norm(x)
        q = self._query_projection(h[:, :q_len]).view(B, q_len, self.H, self.K).transpose(1, 2)
        k = self._key_projection(h).view(B, L, self.H, self.K).transpose(1, 2)
        v = self._value_projection(h).view(B, L, self.H, self.K).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # bias (B, H|1, 1, L)
        x = x[:, :q_len] + self._output_projection(o.transpose(1, 2).reshape(B, q_len, D))
        x = x * valid[:, :q_len, None].to(x.dtype)
        x = x + self._ffn(self._ffn_norm(x))
        return x * valid[:, :q_len, None].to(x.dtype)


class PaddedGraphTransformer(nn.Module):
    def __init__(self, cfg: GraphTransformerConfig):
        super().__init__()
        D = cfg.hid_dim
        self.cfg = cfg
        self._node_projection_dict = nn.ModuleDict({t: nn.Linear(f, D) for t, f in cfg.node_type_to_feat_dim_map})
        if cfg.hop_distance_embedding_size:
            self._anchor_based_input_embedding_dict = nn.ModuleDict(
                {"hop_distance": nn.Embedding(cfg.hop_distance_embedding_size, D)})
        if cfg.key_bias_dim:
            self._anchor_pe_attention_bias_projection = nn.Linear(cfg.key_bias_dim, cfg.num_heads, bias=False)
        self._encoder_layers = nn.ModuleList([Layer(cfg) for _ in range(cfg.num_layers)])
        self._final_norm = nn.LayerNorm(D, eps=cfg.norm_eps)
        if cfg.readout_mode == "anchor_neighbor_attention":
            self._readout_attention = nn.Linear(2 * D, 1)
        self._output_projection = nn.Linear(D, cfg.out_dim)

    def forward(self, x: Tensor, valid: Tensor, node_types: Tensor | None = None, hops: Tensor | None = None,
                key_features: Tensor | None = None, full_last_layer: bool = False) -> tuple[Tensor, Tensor]:
        """(B, L, F) padded tokens + (B, L) prefix mask -> ((B, out_dim), final states (B, Lq, D))."""
        cfg = self.cfg
        vm = valid[..., None].to(x.dtype)
        seq = None
        for i, (t, f) in enumerate(cfg.node_type_to_feat_dim_map):
            y = self._node_projection_dict[t](x[..., :f])
            seq = y if seq is None else torch.where((node_types == i)[..., None], y, seq)
        if hops is not None:
            seq = seq + self._anchor_based_input_embedding_dict["hop_distance"](hops) * vm
        bias = torch.zeros(x.shape[0], 1, 1, x.shape[1], dtype=x.dtype, device=x.device)
        bias = bias.masked_fill(~valid[:, None, None, :], torch.finfo(x.dtype).min / 2)
        if key_features is not None:
            kb = self._anchor_pe_attention_bias_projection(key_features.to(x.dtype))  # (B, L, H)
            bias = bias + kb.permute(0, 2, 1)[:, :, None, :]
        h = seq * vm
        n = len(self._encoder_layers)
        for i, lyr in enumerate(self._encoder_layers):
            last_only = i == n - 1 and cfg.readout_mode == "anchor_only" and not full_last_layer
            h = lyr(h, bias, valid, 1 if last_only else h.shape[1])
        z = self._final_norm(h) * valid[:, : h.shape[1], None].to(h.dtype)
        anchor = z[:, 0]
        if cfg.readout_mode == "anchor_only" or z.shape[1] == 1:
            out = anchor
        else:
            nb, nb_ok = z[:, 1:], valid[:, 1:]
            s = self._readout_attention(torch.cat([anchor[:, None].expand_as(nb), nb], dim=-1))
            s = s.masked_fill(~nb_ok[..., None], torch.finfo(s.dtype).min)
            w = torch.nan_to_num(torch.softmax(s, dim=1), nan=0.0) * nb_ok[..., None].to(s.dtype)
            out = anchor + (nb * w).sum(1)
        out = self._output_projection(out)
        if cfg.should_l2_normalize_embedding_layer_output:
            out = F.normalize(out, p=2, dim=-1)
        return out, z


def padded_inputs(x: Tensor, cu_seqlens: Tensor, *extras: Tensor | None) -> tuple[Tensor, ...]:
    """Packed (T, ...) tensors -> padded (B, L, ...) ones + the (B, L) mask, extras padded with 0."""
    xp, valid = pad(x, cu_seqlens)
    return (xp, valid, *(None if e is None else pad(e, cu_seqlens)[0] for e in extras))
