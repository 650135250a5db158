"""The FedAvg family in the class-incremental stream (``ClassIncremental``): what it keeps of
the method (its proximal term, its own fit, never a silent fallback to FedAvg's stacked fit)
and what it refuses in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedlightning.clients import NodeClassifier
from fedlightning.clients.continual_client import ContinualNodeClassifier
from fedlightning.errors import ConfigError
from fedlightning.federation.stacking import why_not_stacked
from fedlightning.methods.fedavg.class_incremental import ClassIncremental
from fedlightning.methods.fedavg.fedavg import FedAvg
from fedlightning.methods.fedprox.fedprox import FedProx
from fedlightning.methods.scaffold.scaffold import Scaffold


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def test_a_continual_method_is_its_own_class_incremental_form_and_others_are_composed():
    staged = FedProx(mu=0.3).class_incremental()
    assert isinstance(staged, ClassIncremental) and staged.continual and staged.score == "msp"
    assert staged.name == "fedprox"
    module = staged.client_module(nn.Linear(3, 2), sgd)
    assert type(module) is ContinualNodeClassifier and module.prox_mu == 0.3  # FedProx's term
    assert staged.class_incremental() is staged  # continual: itself


def test_the_stack_follows_the_method_so_scaffold_never_falls_back_to_fedavg():
    """FedAvg's stacked fit is kept; SCAFFOLD overrides ``local_fit`` alone, so its
    composition fits one client at a time with SCAFFOLD's own fit."""
    assert FedAvg().class_incremental().local_fit_share is not None
    scaffold = Scaffold().class_incremental()
    module = scaffold.client_module(nn.Linear(3, 2), sgd)
    assert scaffold.local_fit_share is None
    assert "has no local_fit_share" in why_not_stacked(scaffold, module)


def test_a_method_whose_client_module_has_no_class_incremental_form_is_refused():
    class Other(NodeClassifier):
        pass

    class Custom(FedAvg):
        def client_module(self, net, optimizer):
            return Other(net, optimizer)

    with pytest.raises(ConfigError, match="Other, which has no class-incremental form") as e:
        Custom().class_incremental().client_module(nn.Linear(3, 2), sgd)
    assert e.value.key == "algorithm" and "\n" not in str(e.value)
