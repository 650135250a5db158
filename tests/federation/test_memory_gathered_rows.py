"""Stacked FedOGL fits read their stage batches' features as ``GatheredRows`` of the clients'
own rows (issue 49's memory, docs/scaling.md "Memory"): the batches and the fit's union hold
no copy of the features, and every result is bitwise what gathered copies give."""

from __future__ import annotations

import json

import torch
from torch_geometric.data import Data

import fedlightning.methods.continual.continual as continual
import fedlightning.models.stacked as stacked
from fedlightning.clients.replay import stage_batch
from fedlightning.federation.stacking import StackedClients
from fedlightning.methods.continual.continual import (
    ContinualFedAvg,
    gathered_stage_batch,
    with_rows,
)
from fedlightning.models.stacked import GatheredRows, disjoint_union
from fedlightning.train import train


def client_graph(n: int = 40, seed: int = 0) -> Data:
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(0, n, (2, 3 * n), generator=g)
    data = Data(
        x_text=torch.randn(n, 16, generator=g),
        x_image=(torch.rand(n, 8, generator=g) < 0.1).float(),
        modality_mask=torch.rand(n, 2, generator=g) < 0.9,
        edge_index=torch.cat([e, e.flip(0)], 1),
        y=torch.randint(0, 4, (n,), generator=g),
        num_nodes=n,
    )
    data.train_mask = torch.rand(n, generator=g) < 0.6
    return data


def test_gathered_stage_batch_gathers_to_the_stage_batch():
    """Every attribute of the stage batch, the features once gathered, and no copy of the
    features before that (the parts index the client's own tensors)."""
    data = client_graph()
    known, sup, replay = torch.tensor([0, 2, 3]), torch.tensor([2, 3]), torch.tensor([1, 5])
    want = stage_batch(data, known, sup, replay)
    lazy = gathered_stage_batch(data, known, sup, replay)
    for key in ("x_text", "x_image"):
        assert isinstance(lazy[key], GatheredRows)
        ((source, index),) = lazy[key].parts
        assert source is data[key]
        assert torch.equal(index, torch.isin(data.y, known).nonzero().view(-1))
    got = with_rows(lazy)
    assert got.num_nodes == want.num_nodes and sorted(got.keys()) == sorted(want.keys())
    for key, a in want.items():
        b = got[key]
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, key
    assert with_rows(want) is want  # nothing to gather


def test_a_union_of_gathered_batches_keeps_one_part_per_graph():
    graphs = [client_graph(n, s) for n, s in ((30, 1), (12, 2), (25, 3))]
    known, sup, none = torch.tensor([1, 2]), torch.tensor([1]), torch.zeros(0, dtype=torch.long)
    lazy = [gathered_stage_batch(g, known, sup, none) for g in graphs]
    union, ptr = disjoint_union(lazy)
    plain, plain_ptr = disjoint_union([stage_batch(g, known, sup, none) for g in graphs])
    assert ptr == plain_ptr
    assert isinstance(union.x_text, GatheredRows) and len(union.x_text.parts) == 3
    assert torch.equal(union.x_text.materialize(), plain.x_text)
    assert torch.equal(union.edge_index, plain.edge_index) and torch.equal(union.y, plain.y)
    mixed, _ = disjoint_union([lazy[0], lazy[1], stage_batch(graphs[2], known, sup, none)])
    assert torch.equal(mixed.x_text, plain.x_text)  # gathered where not every graph has parts
    assert isinstance(lazy[0].x_text, GatheredRows)  # the graphs themselves unchanged


def run(compose, tmp_path, name: str, overrides: list[str]) -> tuple[dict, dict, dict]:
    cfg = compose(["logger=none", "threads=1", "runner.progress=false", *overrides])
    summary = train(cfg, tmp_path / name)
    checkpoint = torch.load(tmp_path / name / "checkpoint.pt", weights_only=False)
    history = json.loads((tmp_path / name / "history.json").read_text())
    for h in history:
        h.pop("round_time_s", None)
    return summary["metrics"], history, checkpoint["server"]


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(map(same, a, b))
    return a == b or (a != a and b != b)  # NaN equals NaN here


def test_stacked_fedogl_on_gathered_rows_is_bitwise_the_gathered_copies(
    tmp_env, compose, monkeypatch
):
    """FedOGL's demo, three stages stacked: metrics, history and the server's state
    (global model, bases, prototypes) bitwise the same whether the stage batches hold
    gathered copies or ``GatheredRows``, and the stacked steps saw ``GatheredRows``."""
    monkeypatch.setattr(continual, "GATHER_MIN_BYTES", 0)  # the demo's graphs are small
    monkeypatch.setattr(stacked, "FUSE_MIN_BYTES", 0)
    overrides = ["experiment=demo", "federation.rounds=1", "runner.stack_clients=true"]
    seen: list[set] = []  # per stacked step: the types of its features
    step = StackedClients.training_step

    def spied(self, batch, batch_idx=0):
        seen.append({type(v) for k, v in batch.items() if k.startswith("x_")})
        return step(self, batch, batch_idx)

    monkeypatch.setattr(StackedClients, "training_step", spied)
    gathered = run(compose, tmp_env, "gathered", overrides)
    assert seen and all(t == {GatheredRows} for t in seen), seen
    seen.clear()
    monkeypatch.setattr(ContinualFedAvg, "gathers_rows", lambda self, module, executor: False)
    copies = run(compose, tmp_env, "copies", overrides)
    assert seen and all(t == {torch.Tensor} for t in seen), seen
    metrics_a, history_a, server_a = gathered
    metrics_b, history_b, server_b = copies
    assert same(history_a, history_b)
    assert same(
        {k: v for k, v in metrics_a.items() if "time" not in k},
        {k: v for k, v in metrics_b.items() if "time" not in k},
    )
    assert same(server_a, server_b)
