"""The declared broadcast (``Algorithm.downlink``) is checked every round before a client sees
it: a server bug (a missing, misshapen, undeclared or non-finite field) stops the run in one
line naming the field."""

from __future__ import annotations

import pytest
import torch

from fedlightning.errors import FedLightningError
from fedlightning.federation.algorithm import Algorithm
from fedlightning.federation.round import check_downlink
from fedlightning.messages import ServerBroadcast
from fedlightning.methods.scaffold.scaffold import Scaffold
from fedlightning.server import Server

STATE = {"w": torch.ones(3, 2), "b": torch.zeros(2), "steps": torch.tensor(4)}


def broadcast_of(server: Server) -> ServerBroadcast:
    return server.broadcast(1)


def test_the_servers_own_broadcast_meets_the_default_declaration():
    check_downlink(broadcast_of(Server(dict(STATE))), Algorithm().downlink(STATE))


def test_a_broadcast_missing_a_model_field_is_stopped_naming_it():
    b = broadcast_of(Server(dict(STATE)))
    del b.tensors["model.b"]
    with pytest.raises(FedLightningError, match=r"round 1: .*`model.b`: missing"):
        check_downlink(b, Algorithm().downlink(STATE))


def test_a_non_finite_module_field_is_stopped_naming_it():
    b = broadcast_of(Server(dict(STATE)))
    b.tensors["bank.proto"] = torch.tensor([1.0, float("nan")])
    with pytest.raises(FedLightningError, match=r"`bank.proto`: non-finite"):
        check_downlink(b, Algorithm().downlink(STATE))


def test_scaffold_declares_its_control_fields_and_nothing_else():
    alg = Scaffold()
    server = alg.server(dict(STATE))
    server.setup(3)
    b = broadcast_of(server)
    assert {"control.w", "control.b"} <= set(b.tensors)  # floating entries only
    spec = alg.downlink(server.global_state)
    check_downlink(b, spec)
    b.tensors["control.w"] = torch.zeros(2, 3)  # the model entry is [3, 2]
    with pytest.raises(FedLightningError, match=r"`control.w`: shape \[2, 3\], expected \[3, 2\]"):
        check_downlink(b, spec)
    b = broadcast_of(server)
    b.tensors["extra.x"] = torch.zeros(1)
    with pytest.raises(FedLightningError, match=r"`extra.x`: undeclared tensor field"):
        check_downlink(b, spec)
