"""SparseLinear: a sparse COO input gives nn.Linear's values and gradients."""

import pytest
import torch
from torch import nn

from fedlightning.models.sparse import SparseLinear


def _pair(seed: int = 0) -> tuple[nn.Linear, SparseLinear]:
    torch.manual_seed(seed)
    ref = nn.Linear(30, 8).double()
    torch.manual_seed(seed)
    return ref, SparseLinear(30, 8).double()


def _multi_hot(n: int = 50, d: int = 30) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return (torch.rand(n, d, generator=g, dtype=torch.double) < 0.1).double() * 3.0


def test_dense_input_is_nn_linear_bit_for_bit() -> None:
    ref, lin = _pair()
    x = torch.randn(7, 30, dtype=torch.double)
    assert torch.equal(ref(x), lin(x))
    assert ref.state_dict().keys() == lin.state_dict().keys()


def test_sparse_values_and_gradients_equal_dense() -> None:
    ref, lin = _pair()
    x = _multi_hot()
    ref(x).square().sum().backward()
    out = lin(x.to_sparse())
    out.square().sum().backward()
    torch.testing.assert_close(out, ref(x))
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad)


def test_uncoalesced_duplicates_are_summed() -> None:
    _, lin = _pair()
    x = torch.sparse_coo_tensor([[0, 0, 3], [2, 2, 5]], [1.0, 2.0, 4.0], (5, 30)).double()
    dense = torch.zeros(5, 30, dtype=torch.double)
    dense[0, 2], dense[3, 5] = 3.0, 4.0
    torch.testing.assert_close(lin(x), lin(dense))


def test_sparse_input_with_grad_is_refused() -> None:
    _, lin = _pair()
    x = _multi_hot().to_sparse().requires_grad_()
    with pytest.raises(ValueError, match="takes no gradient"):
        lin(x)


def test_kept_csr_structures_give_torchs_own_sparse_products_bitwise() -> None:
    """The CSR structures found once per pattern give the products torch's own sparse paths
    compute (``to_sparse_csr`` forward, the transposed COO ``torch.sparse.mm`` backward),
    bit for bit, step after step with new values on one pattern (a dropout's)."""
    from fedlightning.models.sparse import csr_structure

    torch.manual_seed(3)
    x = (torch.rand(60, 40) < 0.15).float().to_sparse_coo().coalesce()
    w, b = torch.randn(5, 40, requires_grad=True), torch.randn(5, requires_grad=True)
    lin = SparseLinear(40, 5)
    with torch.no_grad():
        lin.weight.copy_(w), lin.bias.copy_(b)
    for step in range(3):
        values = x.values() * (torch.rand(x._nnz()) < 0.5).float() * 2.0
        xs = torch.sparse_coo_tensor(x.indices(), values, x.shape, is_coalesced=True)
        g = torch.randn(60, 5)
        lin.weight.grad = None
        out = lin(xs)
        out.backward(g)
        assert torch.equal(out, torch.addmm(b, xs.to_sparse_csr(), w.t()).detach())
        x_t = torch.sparse_coo_tensor(xs.indices().flip(0), values, (40, 60))
        assert torch.equal(lin.weight.grad, torch.sparse.mm(x_t, g).t())
        torch.testing.assert_close(lin.weight.grad, g.t() @ xs.to_dense())
        if step == 0:
            kept = csr_structure(xs)
        assert all(a is b for a, b in zip(csr_structure(xs), kept, strict=True))
    other = (torch.rand(60, 40) < 0.15).float().to_sparse_coo().coalesce()  # another pattern
    assert csr_structure(other)[0] is not kept[0]
