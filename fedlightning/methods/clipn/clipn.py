"""CLIPN (Wang et al., ICCV 2023) in the class-incremental stream, as a composition.

FedOGL's adaptation rule: local training with FedAvg and the shared class-balanced replay
budget. Each client's net carries CLIPN's "no" branch (:class:`~fedlightning.methods.clipn.clipn_client.NoBranch`,
fields ``model.no_branch.*`` of the uplink, averaged by FedAvg with the rest of the model);
the rejection score is CLIPN's ATD over the known classes
(:func:`~fedlightning.methods.clipn.clipn_score.atd_known_score`), its sign checked on validation
(docs/fedogl.md, "CLIPN").

:class:`RetrievalCLIPN` is its retrieval reading (``cir_clipn``): the "no" branch over the
item embeddings, each query scored by ATD over its split's known-class items.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from fedlightning.errors import ConfigError
from fedlightning.federation.retrieval_stages import split_scores
from fedlightning.methods.clipn.clipn_client import CLIPNClassifier, CLIPNRetrievalClient, NoBranch
from fedlightning.methods.clipn.clipn_score import atd_known_score, retrieval_atd, yes_probability
from fedlightning.methods.continual.continual import ContinualFedAvg
from fedlightning.methods.continual.retrieval_baselines import (
    ContinualRetrieval,
    check_retrieval_net,
)

PREFIX = "no_branch."


def check_clipn(lambda_no: float, scale: float) -> None:
    """CLIPN's hyperparameters: ``lambda_no`` > 0 and ``scale`` > 0."""
    for key, v in (("lambda_no", lambda_no), ("scale", scale)):
        if isinstance(v, bool) or not float(v) > 0:
            raise ConfigError(f"algorithm.{key}", f"must be > 0, got {v!r}")


def load_branch(branch: NoBranch, global_state: dict) -> NoBranch:
    """``branch`` with the global model's ``no_branch.*`` weights."""
    branch.load_state_dict(
        {k[len(PREFIX) :]: v for k, v in global_state.items() if k.startswith(PREFIX)}
    )
    return branch


class CLIPNSettings:
    """What both CLIPN readings share (a mixin before their FedAvg base): the validated
    ``lambda_no`` and ``scale``, the name ``clipn``, the score's sign checked on validation,
    and the "no" branch: the net's (FedAvg'd with the model) and the server's copy that
    the global weights are loaded into."""

    calibrate_direction = True

    def __init__(self, lambda_no: float = 0.5, scale: float = 10.0, **kw: Any) -> None:
        check_clipn(lambda_no, scale)
        kw.setdefault("name", "clipn")
        super().__init__(**kw)
        self.lambda_no, self.scale = float(lambda_no), float(scale)
        self._branch: NoBranch | None = None

    def add_branch(self, net: nn.Module, dim: int, classes: int) -> None:
        """A :class:`NoBranch` of ``dim`` by ``classes`` on ``net`` (unless it has one) and
        the server's copy."""
        if not hasattr(net, "no_branch"):
            net.no_branch = NoBranch(dim, classes)
        self._branch = NoBranch(dim, classes)


class CLIPN(CLIPNSettings, ContinualFedAvg):
    """FedAvg + replay with CLIPN's learned "no" branch and its ATD score.

    Args:
        lambda_no: weight of the branch's losses (CLIPN's ``0.5``).
        scale: cosine scale :math:`s` of the yes/no softmax (default ``10``).
        **kw: as :class:`~fedlightning.methods.continual.continual.ContinualFedAvg`.
    """

    def client_module(self, net: nn.Module, optimizer: Any) -> CLIPNClassifier:
        if hasattr(net, "pair_mask") or not isinstance(getattr(net, "head", None), nn.Linear):
            raise ConfigError(
                "model",
                f"{type(net).__name__} has no linear class head; cil_clipn needs a "
                "classifier such as model=multimodal_gnn",
            )
        self.add_branch(net, net.head.in_features, net.head.out_features)
        return CLIPNClassifier(
            net, optimizer, lambda_no=self.lambda_no, scale=self.scale, **self.retention_kwargs()
        )

    @torch.no_grad()
    def node_score(
        self, logits: Tensor, known: Tensor, data: Any, reps: dict, global_state: dict
    ) -> Tensor:
        """ATD of the global model: ``p_yes`` of every node and known class from its ``z``,
        the global head's rows and the global "no" branch."""
        branch = load_branch(self._branch, global_state)
        ids = known.bool().nonzero().squeeze(1)
        t = global_state["head.weight"][ids].to(reps["z"].dtype)
        p_yes = yes_probability(reps["z"], t, branch(t, ids), self.scale)
        return atd_known_score(p_yes, logits[:, known.bool()])


class RetrievalCLIPN(CLIPNSettings, ContinualRetrieval):
    """Cross-modal retrieval with CLIPN's "no" branch over the items and its ATD score.

    The net gets a :class:`~fedlightning.methods.clipn.clipn_client.NoBranch` with one offset
    (``model.no_branch.*`` of the uplink, averaged by FedAvg); each client trains it with
    :class:`~fedlightning.methods.clipn.clipn_client.CLIPNRetrievalClient`. A query's score is
    :func:`retrieval_atd` over the known-class items of its split (the items the loop ranks),
    its sign checked on validation.

    Args:
        lambda_no, scale: as :class:`CLIPN`.
        **kw: as :class:`~fedlightning.methods.continual.retrieval_baselines.ContinualRetrieval`.
    """

    def client_module(self, net: nn.Module, optimizer: Any) -> CLIPNRetrievalClient:
        check_retrieval_net(net)
        dim = net.heads[net.item].out_features
        self.add_branch(net, dim, 1)
        return CLIPNRetrievalClient(
            net,
            optimizer,
            lambda_no=self.lambda_no,
            scale=self.scale,
            temperature=self.temperature,
            **self.retention_kwargs(),
        )

    @torch.no_grad()
    def query_scores(
        self, net: nn.Module, q: Tensor, k: Tensor, data: Any, is_known: Tensor, global_state: dict
    ) -> Tensor:
        """Every node's ATD against its split's known-class items (before the sign), with
        the global "no" branch."""
        branch = load_branch(self._branch, global_state)

        def atd(rows: Tensor, items: Tensor) -> Tensor:
            no = branch(items, torch.zeros(items.size(0), dtype=torch.long, device=items.device))
            return retrieval_atd(rows, items, no.to(items.dtype), self.scale, self.temperature)

        return split_scores(atd, q, k, is_known & net.pair_mask(data), data)
