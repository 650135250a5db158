"""nonzero_dropout / InputDropout: the distribution of inverted dropout, drawn for non-zeros.

Expected values are computed here from the definition
``x_tilde = x * m / (1 - p)``, ``m ~ Bernoulli(1 - p)`` i.i.d., not from the implementation.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedlightning.models import InputDropout, MultimodalGNN, nonzero_dropout
from fedlightning.models.cross_modal import CrossModalGNN
from fedlightning.models.dropout import MAX_DENSITY, Dropout, dropout


@pytest.fixture(autouse=True)
def _seeded():
    """Statistical bounds are 5 standard deviations; seeding makes each test one fixed draw."""
    torch.manual_seed(0)


def bag_of_words(n: int = 200, d: int = 300, density: float = 0.02, seed: int = 0) -> torch.Tensor:
    """A sparse non-negative matrix with values other than 1 (so scaling is visible)."""
    g = torch.Generator().manual_seed(seed)
    present = torch.rand(n, d, generator=g) < density
    return present * (torch.rand(n, d, generator=g) + 0.5)


@pytest.mark.parametrize("p", [0.5, 0.3, 0.8])
def test_zeros_stay_zero_and_kept_entries_are_scaled(p):
    x = bag_of_words()
    out = nonzero_dropout(x, p)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.equal(out[x == 0], x[x == 0])
    nz = x != 0
    kept = out[nz] != 0
    assert kept.any() and (~kept).any()
    torch.testing.assert_close(out[nz][kept], x[nz][kept] / (1 - p), rtol=1e-6, atol=0)
    assert torch.all(out[nz][~kept] == 0)
    assert not torch.equal(x, out)  # the input is not modified in place
    assert torch.equal(x, bag_of_words())


@pytest.mark.parametrize("p", [0.5, 0.2])
def test_kept_fraction_matches_one_minus_p(p):
    x = bag_of_words(density=0.05)
    nz = x != 0
    draws = 50
    kept = torch.stack([nonzero_dropout(x, p)[nz] != 0 for _ in range(draws)]).double()
    n = kept.numel()
    sd = math.sqrt(p * (1 - p) / n)
    assert abs(kept.mean().item() - (1 - p)) < 5 * sd
    # Every non-zero entry is dropped at the same rate (no fixed or position-dependent mask):
    # the per-entry keep counts over the draws are Binomial(draws, 1 - p).
    per_entry = kept.sum(0)
    assert per_entry.var().item() == pytest.approx(draws * p * (1 - p), rel=0.1)
    # Masks of different entries are independent: the keep indicators of neighbouring
    # non-zeros are uncorrelated.
    a, b = kept[:, :-1].flatten(), kept[:, 1:].flatten()
    corr = ((a - a.mean()) * (b - b.mean())).mean() / (a.std() * b.std())
    assert abs(corr.item()) < 5 / math.sqrt(a.numel())


def test_expectation_is_preserved():
    p, draws = 0.5, 100
    x = bag_of_words()
    outs = torch.stack([nonzero_dropout(x, p) for _ in range(draws)]).double()
    # sum_j x_j m_j / (1 - p) has mean sum_j x_j and variance sum_j x_j^2 p / (1 - p).
    sd = math.sqrt((x.double() ** 2).sum().item() * p / (1 - p) / draws)
    assert abs(outs.sum((1, 2)).mean().item() - x.double().sum().item()) < 5 * sd
    mean_out = outs.mean(0)
    assert torch.equal(mean_out[x == 0], torch.zeros_like(mean_out[x == 0]))


def test_same_distribution_as_nn_dropout():
    """Kept fractions of the non-zeros under nn.Dropout and nonzero_dropout agree."""
    p, draws = 0.5, 40
    x = bag_of_words(density=0.05)
    nz = x != 0
    ours = torch.stack([nonzero_dropout(x, p)[nz] != 0 for _ in range(draws)]).double().mean()
    ref = torch.stack([F.dropout(x, p, True)[nz] != 0 for _ in range(draws)]).double().mean()
    n = draws * int(nz.sum())
    assert abs((ours - ref).item()) < 5 * math.sqrt(2 * p * (1 - p) / n)


def test_eval_mode_and_p_zero_are_identity():
    x = bag_of_words()
    drop = InputDropout(0.5).eval()
    assert drop(x) is x
    assert nonzero_dropout(x, 0.5, training=False) is x
    assert nonzero_dropout(x, 0.0) is x
    assert torch.equal(nonzero_dropout(x, 1.0), torch.zeros_like(x))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        nonzero_dropout(x, 1.5)


def test_same_seed_same_mask():
    x = bag_of_words()
    torch.manual_seed(7)
    a = nonzero_dropout(x)
    torch.manual_seed(7)
    b = nonzero_dropout(x)
    torch.manual_seed(8)
    c = nonzero_dropout(x)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_dense_input_above_the_threshold_is_standard_dropout():
    x = torch.rand(50, 40) + 0.1  # every entry non-zero
    assert MAX_DENSITY < 1
    torch.manual_seed(3)
    ours = nonzero_dropout(x, 0.5)
    torch.manual_seed(3)
    ref = F.dropout(x, 0.5, True)
    assert torch.equal(ours, ref)


def test_gradient_reaches_kept_entries_only_dense():
    """An input that requires grad: d out / d x = m / (1 - p), zero at a dropped entry."""
    p = 0.4
    x = (torch.rand(30, 20) + 0.1).requires_grad_()
    out = nonzero_dropout(x, p)
    out.sum().backward()
    kept = out.detach() != 0
    assert kept.any() and (~kept).any()
    expected = kept.float() / (1 - p)
    torch.testing.assert_close(x.grad, expected)


def test_gradient_reaches_the_layer_through_kept_inputs_only():
    """Through the non-zero path (input without grad), a linear layer's weight gradient
    sees the dropped input: column j of dL/dW is sum_i g_i * x_tilde_ij."""
    x = bag_of_words(n=40, d=30, density=0.1)
    lin = nn.Linear(30, 4)
    out = nonzero_dropout(x, 0.5)
    lin(out).sum().backward()
    expected = torch.ones(40, 4).T @ out
    torch.testing.assert_close(lin.weight.grad, expected)
    dropped_cols = (out == 0).all(0) & (x != 0).any(0)
    if dropped_cols.any():
        assert torch.all(lin.weight.grad[:, dropped_cols] == 0)


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_input_equals_the_dense_path(layout):
    """Stored values in row-major order: the same seed gives the dense path's result."""
    x = bag_of_words(density=0.05)
    torch.manual_seed(11)
    dense_out = nonzero_dropout(x, 0.5)
    torch.manual_seed(11)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: "CSR support is in beta"
        sparse = x.to_sparse() if layout == "coo" else x.to_sparse_csr()
        out = nonzero_dropout(sparse, 0.5)
    assert out.layout == sparse.layout
    assert torch.equal(out.to_dense(), dense_out)
    d = out.to_dense()
    assert torch.all(d[x == 0] == 0)
    kept = d != 0
    torch.testing.assert_close(d[kept], 2 * x[kept], rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_gradient_reaches_kept_values_only(layout):
    p = 0.5
    x = bag_of_words(n=30, d=20, density=0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        sparse = (x.to_sparse() if layout == "coo" else x.to_sparse_csr()).requires_grad_()
        out = nonzero_dropout(sparse, p)
        out.to_dense().sum().backward()
        grad = sparse.grad.to_dense()
    kept = out.detach().to_dense() != 0
    assert kept.any() and (kept != (x != 0)).any()
    torch.testing.assert_close(grad, kept.float() / (1 - p))


def test_models_use_input_dropout_on_modality_inputs():
    mm = MultimodalGNN({"bow": 30, "text": 8}, num_classes=3)
    assert type(mm.encoders.dropout) is InputDropout
    assert type(mm.dropout) is Dropout  # on the dense representation z: torch's, bitwise
    cm = CrossModalGNN({"text": 8, "bow": 30}, num_classes=3)
    assert type(cm.dropout) is InputDropout
    assert mm.encoders.dropout.p == cm.dropout.p == 0.5
    assert "max_density" in repr(mm.encoders.dropout)


def test_model_output_distribution_matches_nn_dropout():
    """A training-mode forward of MultimodalGNN (fixed weights, sparse bag-of-words input,
    the input dropout the only random draw): the distribution of a scalar of its output over
    seeds is the same with InputDropout and with nn.Dropout (two-sample Kolmogorov-Smirnov
    statistic below its 0.1% critical value; nn.Dropout(0.4) in place of 0.5 exceeds it)."""
    from torch_geometric.data import Data

    n, d, draws = 40, 100, 400
    x = bag_of_words(n=n, d=d, density=0.03)
    data = Data(x_bow=x, edge_index=torch.randint(0, n, (2, 4 * n)), num_nodes=n)
    data.modality_mask = torch.ones(n, 1, dtype=torch.bool)
    net = MultimodalGNN({"bow": d}, num_classes=3, hidden=8).train()
    net.gnn.dropout.p = net.dropout.p = 0.0  # the input dropout alone is random
    ref = copy.deepcopy(net)
    ref.encoders.dropout = nn.Dropout(0.5)

    def samples(model: nn.Module, offset: int, count: int = draws) -> torch.Tensor:
        out = []
        with torch.no_grad():
            for s in range(count):
                torch.manual_seed(offset + s)
                out.append(model(data)[:, 0].sum())
        return torch.stack(out)

    a, b = samples(net, 0), samples(ref, 10_000)
    grid = torch.cat([a, b]).sort().values
    ecdf = lambda v: torch.searchsorted(v.sort().values, grid, right=True) / draws  # noqa: E731
    ks = (ecdf(a) - ecdf(b)).abs().max().item()
    assert ks < 1.95 * math.sqrt(2 / draws)
    assert not torch.equal(b[:5], samples(net, 10_000, 5))  # other draws, hence other bits


def test_a_sparse_input_not_flagged_coalesced_is_coalesced_once_and_drops_alike():
    """A client's features made from sorted indices are not flagged coalesced: the coalesced
    form is computed once per input tensor, and the draws are those of the flagged twin."""
    from fedlightning.models.dropout import coalesced

    whole = torch.tensor([[1.0, 0.0, 3.0], [0.0, 0.0, 4.0]]).to_sparse()
    rows = torch.sparse_coo_tensor(whole.indices(), whole.values(), whole.shape)
    assert not rows.is_coalesced()
    first = coalesced(rows)
    assert coalesced(rows) is first  # kept, not recomputed
    assert torch.equal(first.indices(), rows.coalesce().indices())
    assert torch.equal(first.values(), torch.tensor([1.0, 3.0, 4.0]))
    flagged = rows.coalesce()
    torch.manual_seed(3)
    a = nonzero_dropout(rows, 0.5).to_dense()
    torch.manual_seed(3)
    b = nonzero_dropout(flagged, 0.5).to_dense()
    assert torch.equal(a, b)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(540, 64), (7,), (3, 4, 5), (20000,)])
@pytest.mark.parametrize("p", [0.5, 0.1, 0.75])
def test_fast_dropout_is_torch_dropout_bitwise(threads, dtype, shape, p):
    """Values, gradient and the generator's state afterwards are torch's own, bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.randn(shape, dtype=dtype)
        results = []
        for fn in (F.dropout, dropout):
            xi = x.clone().requires_grad_(True)
            torch.manual_seed(5)
            out = fn(xi, p, True)
            out.backward(torch.arange(out.numel(), dtype=dtype).view(shape))
            results.append((out.detach(), xi.grad, torch.get_rng_state()))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_fast_dropout_module_is_nn_dropout_and_falls_back_elsewhere():
    x = torch.randn(30, 8)
    for inp in (x, x.t(), x.half(), x[:, :3]):  # contiguous; transposed; half; strided view
        torch.manual_seed(1)
        ref = nn.Dropout(0.4)(inp)
        torch.manual_seed(1)
        assert torch.equal(Dropout(0.4)(inp), ref)
    m = Dropout(0.4).eval()
    assert m(x) is x
    assert torch.equal(Dropout(1.0)(x), torch.zeros_like(x))
    assert dropout(x, 0.0) is x
