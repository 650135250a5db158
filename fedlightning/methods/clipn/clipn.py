"""CLIPN (Wang et al., ICCV 2023) in the class-incremental stream (docs/fedogl.md, "CLIPN"):
FedAvg + replay with the "no" branch in the model, rejection by ATD (sign checked on
validation); :class:`RetrievalCLIPN` its retrieval reading."""

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
    """What both CLIPN readings share (a mixin): ``lambda_no``, ``scale`` and the "no" branch
    on the net and its server copy."""

    calibrate_direction = True

    def __init__(self, lambda_no: float = 0.5, scale: float = 10.0, **kw: Any) -> None:
        check_clipn(lambda_no, scale)
        kw.setdefault("name", "clipn")
        super().__init__(**kw)
        self.lambda_no, self.scale = float(lambda_no), float(scale)
        self._branch: NoBranch | None = None

    def add_branch(self, net: nn.Module, dim: int, classes: int) -> None:
        if not hasattr(net, "no_branch"):
            net.no_branch = NoBranch(dim, classes)
        self._branch = NoBranch(dim, classes)


class CLIPN(CLIPNSettings, ContinualFedAvg):
    """FedAvg + replay with CLIPN's "no" branch (loss weight ``lambda_no``, cosine ``scale``)."""

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
        """ATD of the global model over the known classes."""
        branch = load_branch(self._branch, global_state)
        ids = known.bool().nonzero().squeeze(1)
        t = global_state["head.weight"][ids].to(reps["z"].dtype)
        p_yes = yes_probability(reps["z"], t, branch(t, ids), self.scale)
        return atd_known_score(p_yes, logits[:, known.bool()])


class RetrievalCLIPN(CLIPNSettings, ContinualRetrieval):
    """Retrieval with a one-offset "no" branch over the items; a query's score is
    :func:`retrieval_atd` over its split's known-class items."""

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
        branch = load_branch(self._branch, global_state)

        def atd(rows: Tensor, items: Tensor) -> Tensor:
            no = branch(items, torch.zeros(items.size(0), dtype=torch.long, device=items.device))
            return retrieval_atd(rows, items, no.to(items.dtype), self.scale, self.temperature)

        return split_scores(atd, q, k, is_known & net.pair_mask(data), data)
