"""FedSSP: GSKS's uniform mean, PGPA's global mean, running mean and penalty by hand; the
client's loss carries the penalty."""

from __future__ import annotations

import torch

from fedlightning.messages import ClientUpdate
from fedlightning.methods.fedssp.fedssp_client import (
    FedSSPClassifier,
    mean_representation,
    momentum_mean,
    pgpa_penalty,
)
from fedlightning.methods.fedssp.fedssp_server import GlobalMean, global_mean, uniform_average


def test_uniform_average_ignores_num_examples():
    a = ClientUpdate(1, {"model.w": torch.tensor([1.0, 2.0])}, {"num_examples": 1.0}, client_id=0)
    b = ClientUpdate(1, {"model.w": torch.tensor([3.0, 6.0])}, {"num_examples": 99.0}, client_id=1)
    assert torch.equal(uniform_average([a, b])["w"], torch.tensor([2.0, 4.0]))


def test_global_mean_module_by_hand():
    mod = GlobalMean()
    assert mod.broadcast_fields() == {}
    ups = [
        ClientUpdate(1, {"mean": torch.tensor([1.0, 0.0])}, {}, client_id=0),
        ClientUpdate(1, {"mean": torch.tensor([0.0, 4.0])}, {}, client_id=1),
    ]
    mod.aggregate(1, ups)
    assert torch.equal(mod.broadcast_fields()["mean.global"], torch.tensor([0.5, 2.0]))
    assert torch.equal(global_mean([torch.tensor([2.0]), torch.tensor([4.0])]), torch.tensor([3.0]))


def test_pgpa_terms_by_hand():
    h = torch.tensor([[1.0, 2.0], [3.0, 4.0], [9.0, 9.0]])
    m = mean_representation(h, torch.tensor([True, True, False]))
    assert torch.equal(m, torch.tensor([2.0, 3.0]))
    assert torch.equal(momentum_mean(torch.zeros(2), m, 0.5), torch.tensor([1.0, 1.5]))
    run = momentum_mean(torch.tensor([0.0, 2.0]), m, 0.75)  # 0.25 * prev + 0.75 * m
    assert torch.equal(run, torch.tensor([1.5, 2.75]))
    run = torch.tensor([1.0, 2.0])
    # tau/2 * mean((1-0)^2, (2-4)^2) = 50 * 5 / 2
    assert float(pgpa_penalty(run, torch.tensor([0.0, 4.0]), 100.0)) == 125.0


def test_the_clients_loss_carries_the_alignment_term():
    from torch_geometric.data import Data

    from fedlightning.methods.fedssp.spectral import SpectralGNN

    torch.manual_seed(0)
    net = SpectralGNN({"a": 4}, 3, hidden=8, eigs=4, heads=2, dropout=0.0)
    module = FedSSPClassifier(net, torch.optim.SGD, tau_mean=100.0, momentum=0.5)
    n = 8
    a = torch.arange(n - 1)
    batch = Data(
        x_a=torch.randn(n, 4),
        modality_mask=torch.ones(n, 1, dtype=torch.bool),
        edge_index=torch.stack([torch.cat([a, a + 1]), torch.cat([a + 1, a])]),
        y=torch.tensor([0, 1, 0, 1, 0, 1, 0, 1]),
        num_nodes=n,
    )
    batch.sup_mask = torch.tensor([True] * 6 + [False] * 2)
    batch.replay_mask = torch.zeros(n, dtype=torch.bool)
    module.set_stage(torch.tensor([0, 1]), None, None)
    module.set_global_mean(None)
    plain = float(module.training_step(batch).detach())
    glob = torch.full((8,), 0.3)
    module.set_global_mean(glob)
    with_term = float(module.training_step(batch).detach())
    with torch.no_grad():
        g = net.representations(batch)["g"]
    run = 0.5 * g[batch.sup_mask].mean(0) - glob  # the code's reset running mean, minus glob
    assert abs((with_term - plain) - 50.0 * float(run.pow(2).mean())) < 1e-3
