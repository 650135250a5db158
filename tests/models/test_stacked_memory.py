"""The stacked execution's memory: unions that share the clients' feature rows, and GCN
propagation in edge chunks, each bitwise what it replaces."""

from __future__ import annotations

import torch
from torch_geometric.data import Batch, Data
from torch_geometric.nn import GCNConv
from torch_geometric.nn.conv.gcn_conv import gcn_norm

import fedlightning.models.stacked as stacked
from fedlightning.models.stacked import Segments, disjoint_union, joined_rows, owns_storage


def graphs(sizes: list[int], seed: int = 0) -> list[Data]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        e = torch.randint(0, n, (2, 3 * n), generator=g)
        out.append(
            Data(
                x_a=torch.randn(n, 5, generator=g),
                x_b=torch.randn(n, 3, generator=g),
                edge_index=e,
                y=torch.randint(0, 4, (n,), generator=g),
                train_mask=torch.rand(n, generator=g) < 0.5,
                num_nodes=n,
            )
        )
    return out


def test_joined_rows_is_a_view_of_adjacent_rows_and_a_copy_otherwise():
    base = torch.randn(10, 4)
    parts = [base[0:3], base[3:7], base[7:10]]
    view = joined_rows(parts)
    assert torch.equal(view, torch.cat(parts))
    assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    gap = [base[0:3], base[4:7]]  # not adjacent: a concatenation
    out = joined_rows(gap)
    assert torch.equal(out, torch.cat(gap)) and owns_storage(out)
    others = [torch.randn(2, 4), torch.randn(3, 4)]
    assert torch.equal(joined_rows(others), torch.cat(others))


def test_disjoint_union_equals_pyg_batch():
    gs = graphs([7, 4, 9])
    union, ptr = disjoint_union(gs)
    want = Batch.from_data_list(gs)
    assert ptr == [0, 7, 11, 20]
    for key in ("x_a", "x_b", "edge_index", "y", "train_mask", "batch", "ptr"):
        assert torch.equal(union[key], want[key]), key
    assert union.num_nodes == want.num_nodes == 20


def test_bind_shares_the_graphs_rows_and_keeps_their_values():
    gs = graphs([6, 3, 8], seed=1)
    before = [(g.x_a.clone(), g.x_b.clone(), g.edge_index) for g in gs]
    seg = Segments(3)
    union = seg.bind(gs)
    for g, (a, b, e), (_, lo, hi) in zip(gs, before, seg.ranges(), strict=True):
        assert torch.equal(g.x_a, a) and torch.equal(g.x_b, b) and g.edge_index is e
        # the graph's features are now the union's rows: one copy in memory
        assert g.x_a.untyped_storage().data_ptr() == union.x_a.untyped_storage().data_ptr()
        assert torch.equal(union.x_a[lo:hi], a)
    assert seg.bind(gs) is union  # the same graphs, unchanged: the union already built
    # another stack binding the same graphs gets a view of the same rows, no copy
    other = Segments(3).bind(gs)
    assert other.x_b.untyped_storage().data_ptr() == union.x_b.untyped_storage().data_ptr()
    assert torch.equal(other.x_b, union.x_b)


def test_bind_leaves_rows_it_does_not_own_alone():
    whole = graphs([12], seed=2)[0]
    parts = [Data(x_a=whole.x_a[:5], num_nodes=5), Data(x_a=whole.x_a[7:], num_nodes=5)]
    seg = Segments(2)
    union = seg.bind(parts)
    assert torch.equal(union.x_a, torch.cat([whole.x_a[:5], whole.x_a[7:]]))
    ptr = whole.x_a.untyped_storage().data_ptr()
    assert all(p.x_a.untyped_storage().data_ptr() == ptr for p in parts)  # not replaced


def test_chunked_propagation_is_pyg_propagate_bitwise():
    threads = torch.get_num_threads()
    try:
        for t, chunk in [(1, 97), (2, 1 << 16), (2, 500)]:
            torch.set_num_threads(t)
            g = torch.Generator().manual_seed(t + chunk)
            n, d = 300, 16
            ei = torch.randint(0, n, (2, 5000), generator=g)
            conv = GCNConv(8, d)
            ei, w = gcn_norm(ei, None, n, False, True, "source_to_target", torch.float32)
            h = conv.lin(torch.randn(n, 8, generator=g)).detach()
            h1, h2 = h.clone().requires_grad_(), h.clone().requires_grad_()
            want = conv.propagate(ei, x=h1, edge_weight=w)
            old, stacked.EDGES_PER_CHUNK = stacked.EDGES_PER_CHUNK, chunk
            try:
                got = stacked._Propagate.apply(h2, ei, w)
            finally:
                stacked.EDGES_PER_CHUNK = old
            assert torch.equal(got, want)
            grad = torch.randn(want.shape, generator=g)
            want.backward(grad)
            got.backward(grad)
            assert torch.equal(h2.grad, h1.grad)
    finally:
        torch.set_num_threads(threads)
