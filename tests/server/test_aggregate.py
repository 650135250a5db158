import pytest
import torch

from fedlightning.messages import ClientUpdate
from fedlightning.server import Server, fedavg, weighted_average


def test_weighted_average_hand_computed():
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor(3.0)}
    b = {"w": torch.tensor([4.0, 8.0]), "b": torch.tensor(-3.0)}
    out = weighted_average([a, b], [1, 2])
    # (1*[1,2] + 2*[4,8]) / 3 = [3, 6];  (1*3 + 2*-3) / 3 = -1
    assert torch.equal(out["w"], torch.tensor([3.0, 6.0]))
    assert out["b"].item() == pytest.approx(-1.0)


def test_integer_buffers_are_averaged_not_dropped():
    a = {"num_batches_tracked": torch.tensor(10), "running_mean": torch.tensor([0.0])}
    b = {"num_batches_tracked": torch.tensor(20), "running_mean": torch.tensor([1.0])}
    out = weighted_average([a, b], [3, 1])
    # (3*10 + 1*20)/4 = 12.5 -> rounds to 12 (half to even); mean (0*3 + 1*1)/4 = 0.25
    assert out["num_batches_tracked"].dtype == torch.int64
    assert out["num_batches_tracked"].item() == 12
    assert out["running_mean"].item() == pytest.approx(0.25)


def test_batchnorm_buffers_survive_fedavg():
    bn1, bn2 = torch.nn.BatchNorm1d(2), torch.nn.BatchNorm1d(2)
    bn1(torch.tensor([[0.0, 0.0], [2.0, 4.0]]))
    bn2(torch.tensor([[4.0, 8.0], [6.0, 12.0]]))
    ups = [
        ClientUpdate(
            1,
            {f"model.{k}": v for k, v in bn.state_dict().items()},
            {"num_examples": 1.0},
            client_id=i,
        )
        for i, bn in enumerate((bn1, bn2))
    ]
    out = fedavg(ups)
    assert set(out) == set(bn1.state_dict())
    # running_mean after one batch with momentum 0.1: 0.1 * batch mean
    assert torch.allclose(out["running_mean"], 0.1 * torch.tensor([(1 + 5) / 2, (2 + 10) / 2]))
    assert out["num_batches_tracked"].item() == 1


def test_weighted_average_rejects_bad_weights():
    s = {"w": torch.zeros(1)}
    with pytest.raises(ValueError, match="not all zero"):
        weighted_average([s, s], [0, 0])
    with pytest.raises(ValueError, match="one weight per state"):
        weighted_average([s], [1, 2])


def test_server_broadcast_is_a_copy_and_aggregates_by_examples():
    srv = Server({"w": torch.zeros(2)})
    bc = srv.broadcast(1)
    bc.tensors["model.w"] += 5  # a client mutating its copy must not touch the server
    assert torch.equal(srv.global_state["w"], torch.zeros(2))
    ups = [
        ClientUpdate(1, {"model.w": torch.tensor([1.0, 1.0])}, {"num_examples": 30.0}, client_id=0),
        ClientUpdate(1, {"model.w": torch.tensor([5.0, 9.0])}, {"num_examples": 10.0}, client_id=1),
    ]
    srv.aggregate(1, ups)
    # (30*[1,1] + 10*[5,9]) / 40 = [2, 3]
    assert torch.allclose(srv.global_state["w"], torch.tensor([2.0, 3.0]))
    state = srv.state_dict()
    srv2 = Server({"w": torch.zeros(2)})
    srv2.load_state_dict(state)
    assert torch.equal(srv2.global_state["w"], srv.global_state["w"])


def test_server_never_imports_lightning():
    import ast
    from pathlib import Path

    import fedlightning.server as pkg

    for f in Path(pkg.__file__).parent.glob("*.py"):
        tree = ast.parse(f.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not any(n.split(".")[0] in ("lightning", "pytorch_lightning") for n in names), f
