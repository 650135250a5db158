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
