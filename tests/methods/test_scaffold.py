"""SCAFFOLD, the worked example of "Adding a method": its equations by hand, one client's
corrected fit against a plain torch loop, and runs that resume bitwise and refuse what they
cannot do in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.data import Data

from fedlightning.clients import NodeClassifier
from fedlightning.data.partition import TRAIN, Partition
from fedlightning.data.streams import ClassStream
from fedlightning.errors import ConfigError
from fedlightning.federation.algorithm import FederatedClient
from fedlightning.federation.executors import LeanExecutor
from fedlightning.federation.stacking import fit_stacked, why_not_stacked
from fedlightning.messages import ServerBroadcast
from fedlightning.methods.scaffold.scaffold import ControlCorrection, Scaffold, client_control
from fedlightning.methods.scaffold.scaffold_server import ControlVariates, control_update
from fedlightning.models.stacked import copy_state
from fedlightning.programs.graph_program import build_model, load_graph
from fedlightning.server.aggregate import as_model_fields
from fedlightning.train import train

REPO = Path(__file__).resolve().parents[2]
RUN = [
    "experiment=fl_synthetic",
    "algorithm=scaffold",
    "federation.rounds=2",
    "federation.clients=3",
    "logger=none",
]
CIL = [
    "experiment=cil_cora",
    "algorithm=scaffold",
    "federation.rounds=1",
    "federation.clients=3",
    "federation.robust=none",  # every client's update reaches line 17
    "logger=none",
]


def test_client_control_is_option_two_by_hand():
    # c_i+ = c_i - c + (x - y) / (K lr): 0.5 - 0.25 + (1.0 - 0.4) / (2 * 0.1) = 3.25
    out = client_control(*(torch.tensor([v]) for v in (0.5, 0.25, 1.0, 0.4)), steps=2, lr=0.1)
    assert torch.allclose(out, torch.tensor([3.25]))


def test_server_control_moves_by_the_sum_over_all_clients():
    # c + (1/N) sum_S dc_i with N = 4 clients, 2 sampled: 1 + (2 + 6) / 4 = 3
    c = control_update(torch.tensor([1.0]), [torch.tensor([2.0]), torch.tensor([6.0])], 4)
    assert c.item() == 3.0
    module = ControlVariates()
    module.setup({"w": torch.zeros(2), "steps": torch.zeros(1, dtype=torch.long)}, num_clients=4)
    assert set(module.broadcast_fields()) == {"control.w"}  # floating entries only


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, data: Data) -> torch.Tensor:
        return self.lin(data.x)


def test_a_corrected_fit_equals_a_plain_torch_loop():
    """Line 10's corrected steps and line 12's new control variate, against the same steps
    written out with autograd."""
    torch.manual_seed(0)
    data = Data(x=torch.randn(6, 3), y=torch.tensor([0, 1, 0, 1, 1, 0]))
    data.train_mask = torch.tensor([True, True, True, True, False, False])
    net, lr, steps = Linear(), 0.2, 3
    x = {k: v.detach().clone() for k, v in net.state_dict().items()}
    c = {k: torch.full_like(v, 0.05) for k, v in x.items()}
    ci = {k: torch.full_like(v, -0.1) for k, v in x.items()}
    algorithm = Scaffold()
    module = NodeClassifier(net, lambda params: torch.optim.SGD(params, lr=lr))
    client = FederatedClient(0, data, {"control": {k: v.clone() for k, v in ci.items()}})
    tensors = {**as_model_fields(x), **{f"control.{k}": v for k, v in c.items()}}
    update = algorithm.local_fit(module, client, ServerBroadcast(1, tensors), LeanExecutor(), steps)

    w = {k: v.clone().requires_grad_(True) for k, v in x.items()}
    for _ in range(steps):
        logits = data.x @ w["lin.weight"].T + w["lin.bias"]
        loss = F.cross_entropy(logits[data.train_mask], data.y[data.train_mask])
        grads = torch.autograd.grad(loss, [w["lin.weight"], w["lin.bias"]])
        with torch.no_grad():
            for (k, v), g in zip(w.items(), grads, strict=True):
                v -= lr * (g - ci[k] + c[k])
    for k in x:
        assert torch.allclose(update.tensors[f"model.{k}"], w[k].detach(), atol=1e-6)
        new = ci[k] - c[k] + (x[k] - w[k].detach()) / (steps * lr)
        assert torch.allclose(client.state["control"][k], new, atol=1e-5)
        assert torch.allclose(update.tensors[f"control_delta.{k}"], new - ci[k], atol=1e-5)
    assert "overrides local_fit" in why_not_stacked(algorithm, module)  # one client at a time


def test_the_correction_hook_works_on_a_stack_of_clients():
    """``client_grads`` hands a per-client hook each client's gradients: two clients fitted
    as one stack, each with its own correction, end where each one's corrected fit alone
    ends."""
    torch.manual_seed(1)
    graphs = []
    for n in (6, 5):
        data = Data(x=torch.randn(n, 3), y=torch.randint(0, 2, (n,)))
        data.train_mask = torch.ones(n, dtype=torch.bool)
        graphs.append(data)
    net, lr, steps = Linear(), 0.2, 3
    start = {k: v.detach().clone() for k, v in net.state_dict().items()}
    corrections = [{k: torch.full_like(v, 0.1 * (j + 1)) for k, v in start.items()} for j in (0, 1)]

    def module() -> NodeClassifier:
        own = Linear()
        own.load_state_dict(start)
        return NodeClassifier(own, lambda params: torch.optim.SGD(params, lr=lr))

    alone = []
    for data, correction in zip(graphs, corrections, strict=True):
        m = module()
        LeanExecutor().fit(m, data, steps, [ControlCorrection(correction)])
        alone.append(m.net.state_dict())
    fitted = fit_stacked(
        module(), graphs, LeanExecutor(), steps, [ControlCorrection(*corrections)], seeds=[0, 1]
    )
    for k, own in enumerate(alone):
        for name, w in copy_state(fitted.net, k).items():
            torch.testing.assert_close(w, own[name], atol=1e-6, rtol=1e-5)
    assert not torch.allclose(alone[0]["lin.weight"], alone[1]["lin.weight"])


def test_scaffold_runs_and_its_uplink_carries_the_control_deltas(tmp_env, compose):
    s = train(compose(RUN), tmp_env / "r", verbose=False)
    assert s["tags"]["method"] == "scaffold"
    fields = s["comm"]["fields"]
    assert any(k.startswith("control_delta.") for k in fields)
    model = sum(v["up"] for k, v in fields.items() if k.startswith("model."))
    control = sum(v["up"] for k, v in fields.items() if k.startswith("control_delta."))
    assert control == model  # one change per model weight (the net has no buffers)


@pytest.mark.slow
@pytest.mark.parametrize("run", [RUN, [*CIL, "protocol.stream.stages=[2,2]"]], ids=["fl", "cil"])
def test_a_killed_scaffold_run_resumes_bitwise(run, tmp_env, compose, shared_data, monkeypatch):
    """Killed in round 2 (class-incremental: the second stage's round), resumed: the same
    results, the clients' control variates coming back from the checkpoint."""
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    reference = train(compose(run), tmp_env / "full", verbose=False)
    env = {**os.environ, "PYTHONPATH": str(REPO), "FEDLIGHTNING_CACHE": str(tmp_env / "cache")}
    cmd = [str(Path(sys.executable).parent / "fedlightning"), "train", *run]
    killed = subprocess.run(
        [*cmd, f"hydra.run.dir={tmp_env / 'killed'}", "runner.kill_at=2:2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,  # a hang guard, far above the normal minute
    )
    assert killed.returncode != 0 and "runner.kill_at: SIGKILL" in killed.stderr
    resumed = train(compose([*run, f"resume={tmp_env / 'killed'}"]), tmp_env / "x", verbose=False)
    assert resumed["metrics"] == reference["metrics"] and resumed["comm"] == reference["comm"]


def test_what_scaffold_cannot_do_is_refused_in_one_line(tmp_env, compose):
    with pytest.raises(ConfigError, match="model.optimizer.*plain SGD"):
        train(compose([*RUN, "model.optimizer._target_=torch.optim.Adam"]), tmp_env / "a")
    assert not (tmp_env / "a" / "summary.json").exists()


def server_state(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoint.pt", weights_only=False)["server"]


def test_secure_sums_carry_the_control_deltas_and_equal_the_plain_run(tmp_env, compose):
    """Line 17 reads the clients' control changes only through their sum, which the masked
    shares carry (``summed_fields``): the secure run's model and control variate equal the
    plain run's within the fixed-point tolerance (2^-32 per value and client)."""
    plain = train(compose(RUN), tmp_env / "plain", verbose=False)
    secure = train(compose([*RUN, "federation.secure_sum=true"]), tmp_env / "sec", verbose=False)
    fields = secure["comm"]["fields"]
    assert any(k.startswith("control_delta.") for k in fields)
    a, b = server_state(tmp_env / "plain"), server_state(tmp_env / "sec")
    control_a, control_b = a["modules"]["control"]["control"], b["modules"]["control"]["control"]
    assert control_a.keys() == control_b.keys() and control_a
    assert any(float(v.abs().max()) > 0 for v in control_a.values())  # it moved
    for k in control_a:
        torch.testing.assert_close(control_b[k], control_a[k], atol=1e-5, rtol=1e-4)
    for k, v in a["global_state"].items():
        torch.testing.assert_close(b["global_state"][k], v, atol=1e-5, rtol=1e-4)
    assert secure["metrics"]["test_acc"] == pytest.approx(plain["metrics"]["test_acc"], abs=0.01)


def test_scaffold_runs_class_incremental_and_round_one_is_line_12_and_17_by_hand(
    tmp_env, compose, shared_data, monkeypatch
):
    """SCAFFOLD under ``protocol=cil`` through its FedAvg-family composition (no second
    class or config): after one round on real Cora, every client's control variate is
    :math:`(x^0 - y_i) / (K \\eta_l)` (line 12 from zero), so the global model is
    :math:`x^0 - K \\eta_l \\sum_i w_i c_i / \\sum_i w_i` with :math:`w_i` the client's training
    nodes of the classes it observes at stage 0, and the server's :math:`c = \\frac{1}{N}
    \\sum_i c_i` (line 17 from zero)."""
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    cfg = compose([*CIL, "protocol.stream.stages=[2]"])
    s = train(cfg, tmp_env / "r", verbose=False)
    assert s["experiment"] == "cil_scaffold_cora" and s["tags"]["method"] == "scaffold"
    assert "am" in s["metrics"] and s["rounds"] == 1
    graph = load_graph(cfg)
    net, _, _ = build_model(cfg, {m: x.size(1) for m, x in graph.features.items()}, 7)
    x0 = {k: v.detach() for k, v in net.named_parameters()}
    partition = Partition.load(tmp_env / "r" / "partition.json")
    stream = ClassStream.load(tmp_env / "r" / "stream.json")
    weights = []
    for k in range(3):
        nodes = partition.client_nodes(k)
        train_nodes = nodes[partition.split[nodes] == TRAIN]
        weights.append(
            int(torch.isin(graph.y[train_nodes], torch.tensor(stream.observed[k][0])).sum())
        )
    checkpoint = torch.load(tmp_env / "r" / "checkpoint.pt", weights_only=False)
    controls = [checkpoint["clients"][k]["control"] for k in range(3)]
    server = checkpoint["server"]
    step = cfg.federation.local_epochs * cfg.model.optimizer.lr  # K eta_l
    for key, x in x0.items():
        moved = sum(w * ci[key] for w, ci in zip(weights, controls, strict=True)) / sum(weights)
        torch.testing.assert_close(server["global_state"][key], x - step * moved)
        mean = sum(ci[key] for ci in controls) / 3
        torch.testing.assert_close(server["modules"]["control"]["control"][key], mean)
    assert any(float(controls[0][k].abs().max()) > 0 for k in x0)


def test_class_incremental_controls_carry_across_stages(tmp_env, compose, shared_data, monkeypatch):
    """Two stages: each client's control variate is its own state, carried from stage to
    stage (not reset with the stage's teacher and batch), so with full participation the
    server's :math:`c` stays the mean of the clients' :math:`c_i` (line 17 added up)."""
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    train(compose([*CIL, "protocol.stream.stages=[2,2]"]), tmp_env / "r", verbose=False)
    checkpoint = torch.load(tmp_env / "r" / "checkpoint.pt", weights_only=False)
    controls = [checkpoint["clients"][k]["control"] for k in range(3)]
    assert all(checkpoint["clients"][k]["stage"] == 1 for k in range(3))
    c = checkpoint["server"]["modules"]["control"]["control"]
    for key, v in c.items():
        torch.testing.assert_close(v, sum(ci[key] for ci in controls) / 3)


def test_fedavg_in_the_class_stream_is_cil_fedavg(tmp_env, compose, shared_data, monkeypatch):
    """The composition's stage wiring is ``cil_fedavg``'s: ``algorithm=fedavg`` under
    ``protocol=cil`` gives its metrics and messages exactly (stacked clients)."""
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    run = ["experiment=cil_cora", "federation.rounds=1", "federation.clients=3", "logger=none"]
    a = train(compose([*run, "algorithm=cil_fedavg"]), tmp_env / "a", verbose=False)
    b = train(compose([*run, "algorithm=fedavg"]), tmp_env / "b", verbose=False)
    assert a["metrics"] == b["metrics"] and a["comm"] == b["comm"]
