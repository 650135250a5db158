"""FedMVP's prompted classifier at embedding level (docs/fedogl.md, "FedMVP"): ``f`` cut into
pseudo-tokens attends over the server's class text prototypes; a cosine head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.data import Data

from fedlightning.models.multimodal import MultimodalGNN, masked_fusion

TEXT_BUFFER, SEEN_BUFFER = "class_text", "class_seen"


def geglu(x: Tensor) -> Tensor:
    """GEGLU: ``a * GELU(b)`` of the last axis' halves."""
    a, b = x.chunk(2, dim=-1)
    return a * F.gelu(b)


def cosine_logits(f: Tensor, weight: Tensor, scale: float) -> Tensor:
    """FedMVP's classifier ``s cos(f, w)`` [N, C]."""
    return scale * F.normalize(f, dim=-1) @ F.normalize(weight, dim=-1).t()


def shared_key_attention(q: Tensor, k: Tensor, v: Tensor, heads: int) -> Tensor:
    """Multi-head attention of ``q`` [N, T, d] over one shared ``k``, ``v`` [C, d]."""
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
    """Pseudo-tokens of ``f`` attending over the seen class prototypes, a GEGLU feed-forward,
    mean-pooled to a prompt of ``f``'s width."""

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
        """The prompt of ``f`` (zeros while no class is seen)."""
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
    """Eq. (10)'s backbone with ``z = f + PromptFormer(f; class_text)`` and a cosine head; the
    buffer ``class_text`` holds the server's means of the ``text_modality`` encoder output
    (the first modality when there is none)."""

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
        """``s``, ``g``, the unprompted ``f`` and the text embedding ``text`` (zeros if absent)."""
        feats = {m: data[f"x_{m}"] for m in self.modalities}
        hs = self.encoders(feats)
        mask = data.modality_mask
        s = masked_fusion(hs, mask)
        g = self.gnn(s, data.edge_index)
        f = torch.relu(self.project(torch.cat([s, g, mask.to(s.dtype)], dim=-1)))
        j = self.modalities.index(self.text_modality)
        return {"s": s, "g": g, "f": f, "text": hs[j] * mask[:, j : j + 1].to(s.dtype)}

    def representations(self, data: Data) -> dict[str, Tensor]:
        reps = self.unprompted(data)
        reps["z"] = reps["f"] + self.prompt(reps["f"], self.class_text, self.class_seen > 0)
        return reps

    def text_available(self, data: Data) -> Tensor:
        return data.modality_mask[:, self.modalities.index(self.text_modality)]
