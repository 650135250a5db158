"""FedMVP's prompted classifier at embedding level (docs/fedogl.md, "FedMVP").

FedMVP (Singha et al., ICCV 2025) prompts a frozen CLIP image encoder with a PromptFormer
whose queries are image patch tokens and whose keys/values are class attribute text
features, and classifies by the cosine to the class text features. Here the query is the
node's fused representation ``f`` (Eq. (10)'s ``z``) cut into ``T`` pseudo-tokens, the
keys/values are the server-averaged class text prototypes (a buffer the server writes),
``f_prompted = f + MLP(pool(attention))`` and the head is a cosine classifier.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.data import Data

from fedlightning.models.multimodal import MultimodalGNN, masked_fusion

TEXT_BUFFER, SEEN_BUFFER = "class_text", "class_seen"


def geglu(x: Tensor) -> Tensor:
    r"""GEGLU (Shazeer, 2020), FedMVP's feed-forward gate: :math:`a \odot \mathrm{GELU}(b)`
    of the two halves ``[a, b]`` of the last axis."""
    a, b = x.chunk(2, dim=-1)
    return a * F.gelu(b)


def cosine_logits(f: Tensor, weight: Tensor, scale: float) -> Tensor:
    r"""FedMVP's classifier: :math:`\ell_{ic} = s \cos(f_i, w_c)`, ``[N, C]``."""
    return scale * F.normalize(f, dim=-1) @ F.normalize(weight, dim=-1).t()


def shared_key_attention(q: Tensor, k: Tensor, v: Tensor, heads: int) -> Tensor:
    r"""Multi-head attention of every node's queries over one shared key/value set:
    :math:`\mathrm{softmax}(q_h k_h^\top / \sqrt{d_h})\, v_h` per head ``h``, for ``q``
    ``[N, T, d]`` and ``k``, ``v`` ``[C, d]``; ``[N, T, d]`` (heads concatenated)."""
    n, t, d = q.shape
    dh = d // heads
    qh = q.reshape(n, t, heads, dh)
    kh, vh = k.reshape(-1, heads, dh), v.reshape(-1, heads, dh)
    att = torch.softmax(torch.einsum("nthe,che->nthc", qh, kh) / dh**0.5, dim=-1)
    return torch.einsum("nthc,che->nthe", att, vh).reshape(n, t, d)


class CosineHead(nn.Module):
    """``num_classes`` learnable class vectors scored by :func:`cosine_logits`."""

    def __init__(self, dim: int, num_classes: int, scale: float = 10.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_classes, dim))
        nn.init.normal_(self.weight, std=dim**-0.5)
        self.scale = float(scale)

    def forward(self, f: Tensor) -> Tensor:
        return cosine_logits(f, self.weight, self.scale)


class PromptFormer(nn.Module):
    """Cross-attention of ``tokens`` pseudo-tokens of ``f`` (queries) over the class text
    prototypes (keys and values), a GEGLU feed-forward, mean-pooled and mapped back to a
    prompt of ``f``'s width; classes whose prototype the server has not seen are masked."""

    def __init__(self, dim: int, tokens: int = 4, heads: int = 4, ff_mult: int = 2) -> None:
        super().__init__()
        if dim % tokens:
            raise ValueError(f"model.net.tokens={tokens} must divide model.net.hidden={dim}")
        self.tokens = tokens
        self.q_in = nn.Linear(dim // tokens, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(tokens, dim))
        if dim % heads:
            raise ValueError(f"model.net.heads={heads} must divide model.net.hidden={dim}")
        self.heads = heads
        self.kv_in = nn.Linear(dim, dim)
        self.norm_q, self.norm_ff = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.w_q, self.w_k = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.w_v, self.w_o = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.ff_in, self.ff_out = nn.Linear(dim, 2 * ff_mult * dim), nn.Linear(ff_mult * dim, dim)
        self.out = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))

    def forward(self, f: Tensor, prototypes: Tensor, seen: Tensor) -> Tensor:
        """The prompt ``[N, dim]`` of ``f`` ``[N, dim]`` over ``prototypes[seen]``; zeros
        while no class has a prototype."""
        if not bool(seen.any()):
            return torch.zeros_like(f)
        n = f.size(0)
        q = self.q_in(f.reshape(n, self.tokens, -1)) + self.pos  # [N, T, dim]
        kv = self.kv_in(prototypes[seen])  # [C_seen, dim], shared by every node
        heads = shared_key_attention(
            self.w_q(self.norm_q(q)), self.w_k(kv), self.w_v(kv), self.heads
        )
        attended = self.w_o(heads)
        x = q + attended
        x = x + self.ff_out(geglu(self.ff_in(self.norm_ff(x))))
        return self.out(x.mean(1))


class FedMVPNet(MultimodalGNN):
    r"""Eq. (10)'s backbone whose ``z`` is prompted: :math:`z_i = f_i +
    \mathrm{PromptFormer}(f_i; \{p_c\})`, logits :math:`s\cos(z_i, w_c)`.

    The class text prototypes ``p_c`` (buffer ``class_text`` ``[C, hidden]``, with
    ``class_seen`` ``[C]``) are the server's count-weighted means of the clients' means of
    the ``text_modality`` encoder output (the first modality when the graph has no such
    modality: Cora's bag of words is its text). ``tokens`` and ``heads`` are FedMVP's 4 and
    4; ``scale`` the cosine classifier's ``s``; the rest as :class:`MultimodalGNN`.
    """

    def __init__(
        self,
        in_dims: dict[str, int],
        num_classes: int,
        hidden: int = 64,
        gnn_layers: int = 2,
        conv: str = "gcn",
        dropout: float = 0.5,
        tokens: int = 4,
        heads: int = 4,
        scale: float = 10.0,
        text_modality: str = "text",
    ) -> None:
        super().__init__(in_dims, num_classes, hidden, gnn_layers, conv, dropout)
        self.text_modality = text_modality if text_modality in in_dims else self.modalities[0]
        self.prompt = PromptFormer(hidden, tokens, heads)
        self.head = CosineHead(hidden, num_classes, scale)
        self.register_buffer(TEXT_BUFFER, torch.zeros(num_classes, hidden))
        self.register_buffer(SEEN_BUFFER, torch.zeros(num_classes))

    def unprompted(self, data: Data) -> dict[str, Tensor]:
        """``s``, ``g``, the unprompted ``f`` (Eq. (10)'s ``z``) and each node's text
        embedding ``text`` (zeros where the node has no text), ``[N, hidden]``."""
        feats = {m: data[f"x_{m}"] for m in self.modalities}
        hs = self.encoders(feats)
        mask = data.modality_mask
        s = masked_fusion(hs, mask)
        g = self.gnn(s, data.edge_index)
        f = torch.relu(self.project(torch.cat([s, g, mask.to(s.dtype)], dim=-1)))
        j = self.modalities.index(self.text_modality)
        return {"s": s, "g": g, "f": f, "text": hs[j] * mask[:, j : j + 1].to(s.dtype)}

    def representations(self, data: Data) -> dict[str, Tensor]:
        """:meth:`unprompted`'s and the prompted ``z``, ``[N, hidden]``."""
        reps = self.unprompted(data)
        reps["z"] = reps["f"] + self.prompt(reps["f"], self.class_text, self.class_seen > 0)
        return reps

    def text_available(self, data: Data) -> Tensor:
        """Which nodes have the text modality, ``[N]`` bool."""
        return data.modality_mask[:, self.modalities.index(self.text_modality)]
