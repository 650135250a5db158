"""Work on constant data done once per tensor (fedlightning/models/constant.py): the kept
result is the one a recomputation gives, and any change of its input recomputes it."""

from __future__ import annotations

import copy
import gc

import torch
from torch import nn
from torch_geometric.data import Data
from torch_geometric.nn import GCNConv
from torch_geometric.nn.conv.gcn_conv import gcn_norm

from fedlightning.models.constant import (
    KeptNormGCNConv,
    graphs_identity,
    kept,
    kept_gcn_norm,
    kept_output,
    unchanged,
)
from fedlightning.models.dropout import nonzero_dropout, nonzero_positions, nonzeros


def _graph(n: int = 30, e: int = 90, seed: int = 0) -> Data:
    g = torch.Generator().manual_seed(seed)
    return Data(
        x=torch.randn(n, 8, generator=g),
        edge_index=torch.randint(0, n, (2, e), generator=g),
        y=torch.randint(0, 3, (n,), generator=g),
    )


def test_kept_computes_once_per_live_unchanged_tensor() -> None:
    x, calls = torch.ones(4), []

    def compute() -> float:
        calls.append(1)
        return float(x.sum())

    assert kept(x, "sum", compute) == 4.0
    assert kept(x, "sum", compute) == 4.0 and len(calls) == 1  # kept
    x.add_(1.0)  # in place: its version moves
    assert kept(x, "sum", compute) == 8.0 and len(calls) == 2
    assert kept(x, "sum", compute, valid=lambda v: v != 8.0) == 8.0 and len(calls) == 3
    assert kept(x, "other", compute) == 8.0 and len(calls) == 4  # another key: its own entry


def test_kept_entry_goes_with_its_tensor() -> None:
    from fedlightning.models import constant

    x = torch.ones(3)
    kept(x, "k", lambda: 1)
    slot = (id(x), "k")
    assert slot in constant._KEPT
    del x
    gc.collect()
    assert slot not in constant._KEPT


def test_kept_gcn_norm_is_pyg_gcn_norm_and_follows_in_place_changes() -> None:
    g = _graph()
    ref = gcn_norm(g.edge_index, None, g.num_nodes, False, True, "source_to_target", torch.float)
    got = kept_gcn_norm(g.edge_index, g.num_nodes, dtype=torch.float)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert kept_gcn_norm(g.edge_index, g.num_nodes, dtype=torch.float)[1] is got[1]
    g.edge_index[0, :10] = 0  # rewired in place
    new = gcn_norm(g.edge_index, None, g.num_nodes, False, True, "source_to_target", torch.float)
    again = kept_gcn_norm(g.edge_index, g.num_nodes, dtype=torch.float)
    assert torch.equal(again[1], new[1]) and not torch.equal(again[1], got[1])


def test_kept_norm_gcn_conv_gives_gcn_conv_outputs_bitwise() -> None:
    g = _graph()
    torch.manual_seed(0)
    plain = GCNConv(8, 5)
    kept_conv = KeptNormGCNConv(8, 5)
    kept_conv.load_state_dict(plain.state_dict())
    for _ in range(2):  # the second call uses the kept normalisation
        assert torch.equal(kept_conv(g.x, g.edge_index), plain(g.x, g.edge_index))
    w = torch.rand(g.edge_index.size(1))  # weighted edges take PyG's own path
    assert torch.equal(kept_conv(g.x, g.edge_index, w), plain(g.x, g.edge_index, w))


def test_nonzeros_are_found_once_and_again_after_a_write() -> None:
    x = torch.zeros(20, 30)
    x[3, 4], x[10, 2] = 1.5, -2.0
    pos, values = nonzeros(x)
    assert torch.equal(pos, nonzero_positions(x.reshape(-1)))
    assert values.tolist() == [1.5, -2.0]
    assert nonzeros(x)[0] is pos  # kept
    x[0, 0] = 7.0
    pos2, values2 = nonzeros(x)
    assert pos2.tolist() == [0, 3 * 30 + 4, 10 * 30 + 2] and values2.tolist() == [7.0, 1.5, -2.0]
    torch.manual_seed(1)
    a = nonzero_dropout(x, 0.5)
    torch.manual_seed(1)  # the same draws as without a kept plan
    keep = torch.rand(3) >= 0.5
    expected = torch.zeros_like(x).reshape(-1)
    expected[pos2] = values2 * keep.float() / 0.5
    assert torch.equal(a.reshape(-1), expected)


class _Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)
        self.calls = 0

    def forward(self, data: Data) -> torch.Tensor:
        self.calls += 1
        return self.lin(data.x)


def test_kept_output_once_per_teacher_and_batch() -> None:
    torch.manual_seed(0)
    net = _Counting().eval()
    source = {k: v.clone() for k, v in net.state_dict().items()}
    batch = _graph()
    first = kept_output(net, batch, [source])
    assert torch.equal(first, net.lin(batch.x).detach()) and not first.requires_grad
    assert kept_output(net, copy.copy(batch), [source]) is first  # a shallow copy: same data
    assert net.calls == 1
    source["lin.weight"].mul_(2.0)  # the teacher's weights changed in place
    net.load_state_dict(source)
    assert torch.equal(kept_output(net, batch, [source]), net.lin(batch.x).detach())
    assert net.calls == 2
    other = dict(source)  # another state: recomputed even with equal values
    kept_output(net, batch, [other])
    assert net.calls == 3
    batch.x = batch.x + 1.0  # an attribute replaced
    assert torch.equal(kept_output(net, batch, [other]), net.lin(batch.x).detach())
    assert net.calls == 4


def test_graphs_identity_sees_replaced_and_written_attributes() -> None:
    g = _graph()
    ident = graphs_identity([g])
    assert unchanged(ident, [g]) and unchanged(ident, [copy.copy(g)])
    g.y[0] = 2
    assert not unchanged(ident, [g])
    ident = graphs_identity([g])
    g.flag = True
    assert not unchanged(ident, [g])
    ident = graphs_identity([g])
    g.x = g.x.clone()
    assert not unchanged(ident, [g])
