r"""CLIPN's learned "no" branch at embedding level, and the local training that teaches it.

The classifier's rows are the class prototypes :math:`t_c` ("a photo of a {c}"); the "no"
prototypes are :math:`\bar t_c = g(t_c) + o_c` with :math:`g` a two-layer MLP and
:math:`o_c` a learnable offset per class (CLIPN's "no" text encoder and its learnable
no-prompts). The backbone trains with Eq. (5) as FedAvg + replay does; the branch trains on
the same nodes with :math:`\tfrac{1}{2}(\mathcal{L}_{yes} + \mathcal{L}_{no} +
\mathcal{L}_{tso})` (:mod:`fedlightning.methods.clipn.clipn_score`), with the node embeddings and the
class prototypes detached, as CLIPN keeps CLIP's encoders frozen.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch_geometric.data import Data

from fedlightning.clients.continual_client import ContinualNodeClassifier
from fedlightning.clients.continual_retrieval import ContinualRetrievalClient
from fedlightning.methods.clipn.clipn_score import itbo_losses, tso_loss

__all__ = ["CLIPNClassifier", "CLIPNRetrievalClient", "NoBranch"]


class NoBranch(nn.Module):
    r"""The "no" prototypes :math:`\bar t_c = W_2\,\mathrm{ReLU}(W_1 t_c + b_1) + b_2 + o_c`.

    Args:
        dim: prototype dimension (the classifier's input width).
        num_classes: classes of the graph (one offset each, zero at the start).
    """

    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.offset = nn.Parameter(torch.zeros(num_classes, dim))

    def forward(self, t: Tensor, classes: Tensor) -> Tensor:
        """``t`` ``[C, d]``: the prototypes of class ids ``classes`` ``[C]``; their "no"
        prototypes ``[C, d]``."""
        return self.mlp(t) + self.offset[classes]


class CLIPNClassifier(ContinualNodeClassifier):
    """:class:`ContinualNodeClassifier` plus CLIPN's "no"-branch losses.

    ``net`` has ``embed``, ``dropout``, ``head`` (a linear classifier) and ``no_branch``
    (:class:`NoBranch`), as ``MultimodalGNN`` with the branch attached. ``lambda_no``
    weighs the branch's losses (CLIPN: ``0.5``), ``scale`` is the cosine scale :math:`s`.
    Other arguments: as :class:`ContinualNodeClassifier`.
    """

    stackable = False  # the branch's loss is not in ``objective``

    def __init__(
        self, net: nn.Module, optimizer: Any, lambda_no: float = 0.5, scale: float = 10.0, **kw: Any
    ) -> None:
        super().__init__(net, optimizer, **kw)
        self.lambda_no, self.scale = lambda_no, scale

    def no_loss(self, z: Tensor, batch: Data) -> Tensor:
        """ITBO (yes and no) and TSO on the supervised and replayed nodes, over the known
        classes, without their weight."""
        mask = batch.sup_mask | batch.replay_mask
        t = self.net.head.weight[self.known].detach()
        t_no = self.net.no_branch(t, self.known)
        l_yes, l_no = itbo_losses(
            z[mask].detach(), t, t_no, self.class_index(batch.y[mask]), self.scale
        )
        return l_yes + l_no + tso_loss(t, t_no)

    def training_step(self, batch: Data, batch_idx: int = 0) -> Tensor:
        z = self.net.embed(batch)
        full = self.net.head(self.net.dropout(z))
        loss = self.objective(full, batch, self.teacher_logits(batch))
        return self.with_proximal(loss + self.lambda_no * self.no_loss(z, batch))


class CLIPNRetrievalClient(ContinualRetrievalClient):
    """:class:`ContinualRetrievalClient` plus CLIPN's "no"-branch losses over the items.

    ``net`` returns ``(q, k)`` and has ``pair_mask`` and ``no_branch`` (:class:`NoBranch`
    with one offset). On the paired supervised and replayed nodes, query :math:`i`'s
    matched "text" is its own item :math:`k_i`, the other items are its unmatched ones;
    the branch trains with ITBO (yes and no) and TSO on the detached embeddings, weighted by
    ``lambda_no``, at cosine scale ``scale``. Other arguments: as
    :class:`ContinualRetrievalClient`.
    """

    stackable = False  # the branch's loss is not in the objective

    def __init__(
        self, net: nn.Module, optimizer: Any, lambda_no: float = 0.5, scale: float = 10.0, **kw: Any
    ) -> None:
        super().__init__(net, optimizer, **kw)
        self.lambda_no, self.scale = lambda_no, scale

    def no_loss(self, q: Tensor, k: Tensor, batch: Data) -> Tensor:
        """ITBO (yes and no) and TSO of the paired supervised and replayed nodes, without
        their weight; ``0`` without such a node."""
        mask = (batch.sup_mask | batch.replay_mask) & self.net.pair_mask(batch)
        n = int(mask.sum())
        if n == 0:
            return q.sum() * 0.0 + sum(p.sum() for p in self.net.no_branch.parameters()) * 0.0
        items = k[mask].detach()
        items_no = self.net.no_branch(items, torch.zeros(n, dtype=torch.long, device=k.device))
        l_yes, l_no = itbo_losses(
            q[mask].detach(), items, items_no, torch.arange(n, device=k.device), self.scale
        )
        return l_yes + l_no + tso_loss(items, items_no)

    def training_step(self, batch: Data, batch_idx: int = 0) -> Tensor:
        q, k = self.net(batch)
        loss = self.retrieval_loss(batch, q, k)
        return self.with_proximal(loss + self.lambda_no * self.no_loss(q, k, batch))
