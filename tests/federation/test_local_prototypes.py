"""Fig. 3's local prototypes: each client's own uplinked model on its own subgraph."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fedlightning.federation.stages import ContinualLoop
from fedlightning.messages import ClientUpdate


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def representations(self, data: SimpleNamespace) -> dict[str, torch.Tensor]:
        return {"z": self.lin(data.x)}


def client(k: int, x: list[list[float]], y: list[int]) -> SimpleNamespace:
    data = SimpleNamespace(
        x=torch.tensor(x, dtype=torch.float32),
        y=torch.tensor(y),
        train_mask=torch.ones(len(y), dtype=torch.bool),
    )
    return SimpleNamespace(client_id=k, data=data)


def test_each_client_is_probed_with_the_model_it_sent():
    net = Net()
    glob = {"lin.weight": torch.eye(2), "lin.bias": torch.tensor([1.0, 0.0])}
    clients = [client(0, [[1, 0], [0, 1]], [0, 1]), client(5, [[2, 0]], [0])]
    sent = {  # client 0 sends both fields, client 5 its weight only: its bias is the global one
        0: {"model.lin.weight": 2 * torch.eye(2), "model.lin.bias": torch.zeros(2)},
        5: {"model.lin.weight": torch.tensor([[0.0, 1.0], [1.0, 0.0]])},
    }
    updates = [
        ClientUpdate(round=3, client_id=k, tensors=v, scalars={"num_examples": 1.0})
        for k, v in sent.items()
    ]
    loop = SimpleNamespace(
        module=SimpleNamespace(net=net),
        server=SimpleNamespace(global_state=glob),
        clients=clients,
        last_updates=updates,
    )
    before = {k: v.clone() for k, v in net.state_dict().items()}
    reps = ContinualLoop.uplinked_representations(loop)
    assert [c.client_id for c, _ in reps] == [0, 5]
    # client 0: 2 x + 0 -> [2, 0], [0, 2]; client 5: swap(x) + [1, 0] -> [1, 2]
    assert torch.equal(reps[0][1]["z"], torch.tensor([[2.0, 0.0], [0.0, 2.0]]))
    assert torch.equal(reps[1][1]["z"], torch.tensor([[1.0, 2.0]]))
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())  # a copy probed
    terms = ContinualLoop.prototype_terms_of([0, 1], reps)
    # class 0: client 0's [2, 0] (1 node) and client 5's [1, 2] (1 node) around [1.5, 1]:
    # cos([2,0],[1.5,1]) = 3 / (2 sqrt(3.25)); cos([1,2],[1.5,1]) = 3.5 / (sqrt(5) sqrt(3.25))
    assert terms[0][0] == pytest.approx(1 - 3 / (2 * 3.25**0.5))
    assert terms[0][5] == pytest.approx(1 - 3.5 / (5**0.5 * 3.25**0.5))
    assert terms[1] == {0: pytest.approx(0.0)}  # one client: its own prototype is the mean
