"""FedSSP's spectral GNN: eigenpairs, sine encoding and edge bases against hand or dense
computations; the spectral encoders shape the message passing."""

from __future__ import annotations

import math

import numpy as np
import torch

from fedlightning.methods.fedssp.spectral import (
    SpectralGNN,
    edge_bases,
    laplacian_eigenpairs,
    sine_encoding,
)


def path(n: int) -> torch.Tensor:
    a = torch.arange(n - 1)
    return torch.stack([torch.cat([a, a + 1]), torch.cat([a + 1, a])])


def test_eigenpairs_are_the_smallest_of_the_normalized_laplacian():
    n, k = 30, 6
    ei = path(n)
    e, U = laplacian_eigenpairs(ei, n, k)
    A = np.zeros((n, n))
    A[ei[0], ei[1]] = 1
    d = A.sum(1)
    L = np.eye(n) - A / np.sqrt(d[:, None] * d[None, :])
    vals, vecs = np.linalg.eigh(L)
    np.testing.assert_allclose(e.numpy(), vals[:k], atol=1e-5)
    # eigenvectors up to sign: |<u_ours, u_dense>| = 1, and L u = e u
    np.testing.assert_allclose(np.abs((U.numpy() * vecs[:, :k]).sum(0)), 1.0, atol=1e-4)
    np.testing.assert_allclose(L @ U.numpy(), U.numpy() * e.numpy()[None], atol=1e-4)
    # deterministic sign: every eigenvector leans towards the ramp (1, 2, ..., n)
    assert (np.arange(1, n + 1) @ U.numpy() >= 0).all()


def test_eigenpairs_of_a_tiny_graph_fall_back_to_dense():
    # a single edge: L = [[1, -1], [-1, 1]], eigenvalues 0 and 2
    e, U = laplacian_eigenpairs(torch.tensor([[0, 1], [1, 0]]), 2, 64)
    assert torch.allclose(e, torch.tensor([0.0, 2.0]), atol=1e-6)
    assert torch.allclose(U.abs(), torch.full((2, 2), 1 / math.sqrt(2)), atol=1e-6)


def test_sine_encoding_by_hand():
    enc = sine_encoding(torch.tensor([0.5]), dim=4, scale=100.0)
    # omega_0 = 1, omega_1 = 10000^(-1/2) = 0.01: angles 50 and 0.5
    want = [0.5, math.sin(50.0), math.sin(0.5), math.cos(50.0), math.cos(0.5)]
    assert torch.allclose(enc[0], torch.tensor(want), atol=1e-5)


def test_edge_bases_by_hand():
    # two nodes, one edge each way; U = I (k = 2), filter lambda = (1, 3)
    U = torch.eye(2)
    lam = torch.tensor([[1.0], [3.0]])
    edges, b = edge_bases(lam, U, torch.tensor([[0, 1], [1, 0]]), 2)
    # columns: the identity, then U diag(l) U^T = diag(1, 3) on edges 0->1, 1->0 and the loops
    assert edges.tolist() == [[0, 1, 0, 1], [1, 0, 0, 1]]
    assert torch.equal(b, torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [1.0, 3.0]]))


def graph(n: int = 12) -> object:
    from torch_geometric.data import Data

    g = torch.Generator().manual_seed(0)
    return Data(
        x_a=torch.randn(n, 5, generator=g),
        modality_mask=torch.ones(n, 1, dtype=torch.bool),
        edge_index=path(n),
        num_nodes=n,
    )


def test_the_spectral_encoders_shape_the_logits():
    torch.manual_seed(0)
    net = SpectralGNN({"a": 5}, 3, hidden=8, eigs=4, heads=2).eval()
    data = graph()
    before = net(data)
    with torch.no_grad():
        net.eig_encoder.bias.add_(1.0)
    after_eig = net(data)
    assert not torch.allclose(before, after_eig)
    with torch.no_grad():
        net.filter_encoder[0].weight.mul_(3.0)
    assert not torch.allclose(after_eig, net(data))
    # the preference vector b_k is added to g before the head: z = g + b
    reps = net.representations(data)
    assert torch.allclose(reps["z"], reps["g"] + net.preference)


def test_large_graphs_take_seeded_lobpcg_and_agree_with_dense(monkeypatch):
    import fedlightning.methods.fedssp.spectral as spectral

    g = torch.Generator().manual_seed(0)
    n, k = 120, 4
    ei = torch.randint(0, n, (2, 600), generator=g)
    dense_e, dense_U = laplacian_eigenpairs(ei, n, k)
    monkeypatch.setattr(spectral, "DENSE_UP_TO", 10)
    e, U = laplacian_eigenpairs(ei, n, k)
    assert torch.allclose(e, dense_e, atol=1e-4)
    assert torch.allclose((U * dense_U).sum(0).abs(), torch.ones(k), atol=1e-3)
    again = laplacian_eigenpairs(ei, n, k)
    assert torch.equal(again[0], e) and torch.equal(again[1], U)  # seeded: bitwise


def test_spectral_conv_gradient_is_the_same_on_every_run_on_two_threads(grads_on_two_threads):
    """Messages gathered with ``index_select`` (not ``x[src]``, whose backward accumulated
    in any order on several CPU threads): FedSSP's gradient, and so its runs with
    ``threads: auto``, the same on every run."""
    from fedlightning.methods.fedssp.spectral import SpectralConv

    torch.manual_seed(0)
    conv = SpectralConv(16, dropout=0.0)
    edges = torch.randint(0, 2000, (2, 8000))
    weights = torch.rand(8000, 16)
    grads = grads_on_two_threads(
        torch.randn(2000, 16), lambda x: conv(x, edges, weights).square().sum()
    )
    assert all(torch.equal(grads[0], other) for other in grads[1:])


def test_a_sparse_input_gives_the_logits_of_its_dense_form():
    """A sparse COO modality (coalesced once per tensor, not flagged so by its maker) gives
    the dense input's logits, and bitwise those of its freshly coalesced copy."""
    torch.manual_seed(0)
    net = SpectralGNN({"a": 5}, 3, hidden=8, eigs=4, heads=2).eval()
    data = graph()
    dense = (torch.rand(12, 5) < 0.5).float()
    idx = dense.nonzero().t()
    sparse = torch.sparse_coo_tensor(idx, dense[idx[0], idx[1]], (12, 5))
    assert not sparse.is_coalesced()
    logits = {}
    for name, x in (("dense", dense), ("sparse", sparse), ("coalesced", sparse.coalesce())):
        data.x_a = x
        logits[name] = net(data)
    assert torch.allclose(logits["sparse"], logits["dense"], atol=1e-6)
    assert torch.equal(logits["sparse"], logits["coalesced"])
