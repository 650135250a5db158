"""Node classification on a client's subgraph, full batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.data import Data

from fedlightning.clients.losses import proximal_term
from fedlightning.clients.minibatch import MiniBatch, node_outputs

OptimizerFactory = Callable[..., torch.optim.Optimizer]


class NodeClassifier(pl.LightningModule):
    r"""Local training of a node classifier, one full-batch step per pass over the client's
    subgraph: :math:`\mathrm{CE}(f(G_k)_{V^{tr}_k}, y_{V^{tr}_k}) + \frac{\mu}{2}\lVert w -
    w^t\rVert^2` (FedProx's term when ``prox_mu > 0``, else FedAvg's client). ``optimizer``
    is a partial optimizer, called with the parameters on every local fit.

    ``stackable``: several clients can fit as one stack (:mod:`fedlightning.federation.stacking`);
    a subclass that overrides ``training_step`` is not, unless it says so."""

    stackable: ClassVar[bool] = True
    #: the node masks the loss reads: a mini-batch fit seeds its batches on them
    #: (:mod:`fedlightning.clients.minibatch`)
    loss_masks: ClassVar[tuple[str, ...]] = ("train_mask",)
    #: ``federation.minibatch`` (``None``: every fit full batch), set by the program
    minibatch: MiniBatch | None = None

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if "training_step" in cls.__dict__ and "stackable" not in cls.__dict__:
            cls.stackable = False

    def __init__(self, net: nn.Module, optimizer: OptimizerFactory, prox_mu: float = 0.0) -> None:
        super().__init__()
        self.net = net
        self.optimizer_factory = optimizer
        self.prox_mu = float(prox_mu)
        self.anchor: dict[str, Tensor] = {}
        self.last_loss = float("nan")

    def receive(self, state: dict[str, Tensor]) -> None:
        """Load the global weights; keep a frozen copy as FedProx's anchor."""
        self.net.load_state_dict(state)
        if self.prox_mu > 0:
            self.anchor = {k: v.detach().clone() for k, v in self.net.named_parameters()}

    def on_fit_start(self) -> None:
        """Move FedProx's anchor to the device the fit runs on (a GPU, say)."""
        self.anchor = {k: v.to(self.device) for k, v in self.anchor.items()}

    def forward(self, data: Data) -> Tensor:
        return self.net(data)

    def training_step(self, batch: Data, batch_idx: int = 0) -> Tensor:
        return self.with_proximal(self.objective(self.net(batch), batch))

    def teacher_logits(self, batch: Data) -> Tensor | None:
        """A frozen teacher's logits on ``batch`` (``None``: the objective has no teacher)."""
        return None

    def objective(self, logits: Tensor, batch: Data, teacher: Tensor | None = None) -> Tensor:
        """The data term of the local loss from the net's ``logits`` on ``batch`` (and the
        teacher's, :meth:`teacher_logits`): the mean cross-entropy of the training nodes.
        Stacked clients (:mod:`fedlightning.federation.stacking`) call it per client."""
        return F.cross_entropy(logits[batch.train_mask], batch.y[batch.train_mask])

    def with_proximal(self, loss: Tensor) -> Tensor:
        """``loss`` plus FedProx's term (when ``prox_mu > 0``), kept as ``last_loss``."""
        if self.prox_mu > 0:
            loss = loss + proximal_term(self.net.named_parameters(), self.anchor, self.prox_mu)
        self.last_loss = float(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer_factory(self.parameters())

    @torch.no_grad()
    def evaluate(self, data: Data) -> dict[str, Any]:
        """Correct predictions and node counts per split (``train``, ``val``, ``test``);
        batched over a graph beyond :attr:`minibatch`'s budget (``node_outputs``)."""
        was_training = self.training
        self.eval()
        pred = node_outputs(self.net, data, self.minibatch).argmax(-1)
        self.train(was_training)
        return self.split_counts(pred, data)

    @staticmethod
    def split_counts(pred: Tensor, data: Data) -> dict[str, int]:
        """Correct predictions ``pred`` ``[N]`` and node counts per split of ``data``."""
        out: dict[str, int] = {}
        for split in ("train", "val", "test"):
            m = data[f"{split}_mask"]
            out[f"{split}_correct"] = int((pred[m] == data.y[m]).sum())
            out[f"{split}_total"] = int(m.sum())
        return out
