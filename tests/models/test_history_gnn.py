"""FedGCN's and FedSage+'s equations by hand, and their defining mechanisms: FedGCN's first
layer sees the neighbour sums of other clients; FedSage+'s mended graph has the generated
neighbours."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedlightning.data.temporal.events import EventStream
from fedlightning.data.temporal.ownership import Ownership
from fedlightning.federation.executors import LeanExecutor
from fedlightning.federation.ledger import UP, CommLedger
from fedlightning.federation.runners import SequentialRunner
from fedlightning.methods.fedgcn.fedgcn import FedGCN
from fedlightning.methods.fedgcn.fedgcn_model import (
    FedGCNNet,
    exchange_total,
    first_layer_input,
    mean_aggregate,
    neighbour_sums,
)
from fedlightning.methods.fedsage.fedsage import FedSagePlus
from fedlightning.methods.fedsage.fedsage_model import (
    NeighGen,
    SageNet,
    degree_loss,
    greedy_feature_loss,
    impair,
    local_batch,
    mend,
    sage_mean,
)
from fedlightning.methods.history.history import HistoryGraph

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_neighbour_sums_and_the_global_mean_by_hand():
    x = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]])
    ei = torch.tensor([[0, 0, 1], [1, 2, 2]])  # 0->1, 0->2, 1->2
    s, c = neighbour_sums(x, ei, 3)
    assert s.tolist() == [[3.0, 5.0], [3.0, 3.0], [0.0, 0.0]] and c.tolist() == [2.0, 1.0, 0.0]
    parts = [(torch.tensor([0, 2]), torch.ones(2, 2), torch.tensor([1.0, 2.0]))]
    parts.append((torch.tensor([2]), torch.full((1, 2), 4.0), torch.tensor([1.0])))
    total, count = exchange_total(parts, 3, 2)
    assert total.tolist() == [[1.0, 1.0], [0.0, 0.0], [5.0, 5.0]] and count.tolist() == [1, 0, 3]
    m = first_layer_input(x, total, count)
    assert m[2].tolist() == [(3 + 5) / 4, (3 + 5) / 4] and m[1].tolist() == [0.0, 2.0]
    h = mean_aggregate(x, torch.cat([ei, ei.flip(0)], 1))
    assert torch.allclose(h[2], (x[2] + x[0] + x[1]) / 3)


def test_sage_mean_impair_and_the_losses_by_hand():
    x = torch.tensor([[0.0], [2.0], [4.0], [6.0]])
    ei = torch.tensor([[0, 0, 1, 1, 2, 3], [1, 2, 0, 3, 0, 1]])
    assert sage_mean(x, ei).flatten().tolist() == [3.0, 3.0, 0.0, 2.0]
    kept, hidden, imp, missing = impair(
        ei, torch.arange(4), 4, 0.5, torch.Generator().manual_seed(0)
    )
    assert len(hidden) == 2 and set(kept.tolist()) | set(hidden.tolist()) == {0, 1, 2, 3}
    assert not torch.isin(imp, hidden).any()  # no edge touches a hidden node
    for v, m in missing.t().tolist():  # every kept -> hidden edge, nothing else
        assert v in kept.tolist() and m in hidden.tolist()
    want = sum(1 for a, b in ei.t().tolist() if a in kept.tolist() and b in hidden.tolist())
    assert missing.size(1) == want
    # degree loss: node 0 misses 2 (nodes 1, 2), node 1 misses 1 (node 3); predictions 2.5, 1
    miss = torch.tensor([[0, 0, 1], [1, 2, 3]])
    pred = torch.tensor([2.5, 1.0, 9.0, 9.0])
    want = (0.5 * 0.5**2 + 0.0) / 2  # smooth-L1 (beta 1) over the kept nodes 0 and 1
    assert degree_loss(pred, miss, torch.tensor([0, 1]), 5).item() == pytest.approx(want)
    # greedy L2: node 0's first two slots each take the nearest of x1=2, x2=4
    gen = torch.zeros(4, 3, 1)
    gen[0, :, 0] = torch.tensor([2.5, 3.9, 100.0])  # slot 2 unused (only 2 missing)
    gen[1, :, 0] = torch.tensor([5.0, 100.0, 100.0])  # nearest x3=6: 1
    loss = greedy_feature_loss(gen, x, miss, torch.tensor([0, 1]))
    assert loss.item() == pytest.approx((0.25 + 0.01 + 1.0) / 2, rel=1e-5)


def test_mend_appends_the_predicted_neighbours():
    x = torch.zeros(3, 2)
    ei = torch.tensor([[0, 1], [1, 0]])
    degree = torch.tensor([1.6, 0.2, 7.0])  # round: 2, 0, capped at P=3
    feats = torch.arange(3 * 3 * 2, dtype=torch.float).view(3, 3, 2)
    x2, e2, owner = mend(x, ei, torch.tensor([0, 1, 2]), degree, feats)
    assert owner.tolist() == [0, 0, 2, 2, 2] and x2.shape == (8, 2)
    assert torch.equal(x2[3:5], feats[0, :2]) and torch.equal(x2[5:], feats[2])
    pairs = {tuple(p) for p in e2.t().tolist()}
    assert {(0, 3), (3, 0), (0, 4), (4, 0), (2, 5), (5, 2), (2, 7)} <= pairs
    assert e2.size(1) == 2 + 2 * 5


def toy_world():
    """Two clients: users 0, 1 (client 0) and 2 (client 1); items 3, 4. Item 3 is touched
    by both clients' users."""
    src, dst = np.array([0, 1, 2, 2]), np.array([3, 4, 3, 4])
    stream = EventStream(
        "toy", src, dst, np.arange(4), 5, True, np.array([0, 0, 0, 1, 1]), label=np.zeros(4, int)
    )
    owner = np.array([0, 0, 1, -1, -1])

    class Proto:
        pass

    proto = Proto()
    proto.stream, proto.ownership = stream, Ownership(owner, 2, {})
    torch.manual_seed(0)
    x = torch.randn(5, 4)
    graph = HistoryGraph(
        np.array([0, 1, 2]), np.array([3, 4]), torch.from_numpy(np.stack([src, dst])),
        torch.zeros(4), torch.arange(4), x,
    )  # fmt: skip
    return proto, graph


class Loop:
    seed, epochs = 0, 2
    runner = SequentialRunner(LeanExecutor(), progress=False)


def fedgcn(exchange: bool) -> FedGCN:
    proto, graph = toy_world()
    alg = FedGCN(exchange=exchange)
    alg.attach(None, proto)
    alg.use_history(graph)
    return alg


def test_fedgcn_first_layer_sees_the_other_clients_neighbour_sums():
    alg = fedgcn(exchange=True)
    x = alg.history.x
    ledger = CommLedger()
    alg.before_tasks(Loop(), ledger, "task=0")
    # client 0's row of item 3: its own user 0 and client 1's user 2 (the exchanged sum)
    want = (x[3] + x[0] + x[2]) / 3
    assert torch.allclose(alg.client_graph(0).x[3], want)
    assert torch.allclose(alg.client_graph(1).x[3], want)  # the same global row for both
    # without the exchange, client 0 sees only its own user 0
    local = fedgcn(exchange=False)
    local.before_tasks(Loop(), CommLedger(), "task=0")
    assert torch.allclose(local.client_graph(0).x[3], (x[3] + x[0]) / 2)
    assert not torch.allclose(local.client_graph(0).x[3], want)
    # the ledger: each client once, per node with a local edge its id, d sums and a count
    d = x.size(1)
    assert ledger.total(UP) == (4 + 3) * (d + 2)  # client 0: nodes 0,1,3,4; client 1: 2,3,4
    assert alg.exchange_values() == {0: 4 * (d + 2), 1: 3 * (d + 2)}


def test_fedgcn_net_by_hand():
    net = FedGCNNet(2, 3, 2)
    m = torch.tensor([[1.0, 2.0], [0.0, 1.0]])
    ei = torch.tensor([[0, 1], [1, 0]])
    h = torch.relu(net.lin1(m))
    want = net.lin2(torch.stack([(h[0] + h[1]) / 2, (h[1] + h[0]) / 2]))
    assert torch.allclose(net(m, ei), want)
    assert net.num_values() == 2 * 3 + 3 + 3 * 2 + 2


def test_sage_net_by_hand():
    net = SageNet(2, 3, 2)
    x = torch.tensor([[1.0, 2.0], [0.0, 1.0], [5.0, 5.0]])
    ei = torch.tensor([[0, 1], [1, 0]])  # node 2 isolated: its neighbour mean is zero
    h = torch.relu(
        net.conv1.self_lin(x) + net.conv1.nb_lin(x[[1, 0, 0]] * torch.tensor([[1.0], [1.0], [0.0]]))
    )
    want = net.conv2.self_lin(h) + net.conv2.nb_lin(
        h[[1, 0, 0]] * torch.tensor([[1.0], [1.0], [0.0]])
    )
    assert torch.allclose(net(x, ei), want, atol=1e-6)


def test_fedsage_mended_graph_has_the_generated_neighbours():
    proto, graph = toy_world()
    alg = FedSagePlus(gen_rounds=2, latent=8, num_pred=3)
    alg.attach(None, proto)
    alg.use_history(graph)
    ledger = CommLedger()
    alg.before_tasks(Loop(), ledger, "task=0")
    gen = alg.generator
    with torch.no_grad():
        for k in (0, 1):
            edges = alg.local[k]
            degree, feats = gen(graph.x, edges)
            nodes = torch.unique(edges.flatten())
            n = degree[nodes].round().clamp(0, 3).long()
            g = alg.client_graph(k)
            assert g.x.size(0) == graph.num_nodes + int(n.sum())
            new = graph.num_nodes
            for v, nv in zip(nodes.tolist(), n.tolist(), strict=True):
                for s in range(nv):  # generated node `new` holds fGen's slot s for v
                    assert torch.allclose(g.x[new], feats[v, s])
                    pairs = (g.edge_index[0] == v) & (g.edge_index[1] == new)
                    assert bool(pairs.any())
                    new += 1
    # the generator round: 2 rounds x 2 clients x (NeighGen's delta + a count)
    assert ledger.total(UP) == 2 * 2 * (NeighGen(4, 8, 3).num_values() + 1)
    # force one generated neighbour per node: the mended graph differs from the history
    with torch.no_grad():
        gen.dgen.weight.zero_()
        gen.dgen.bias.fill_(1.0)
    g = alg.mended(alg.local[0])
    assert g.x.size(0) == graph.num_nodes + 4  # nodes 0, 1, 3, 4 each get one
    plain = FedSagePlus(mending=False)
    plain.attach(None, proto)
    plain.use_history(graph)
    assert plain.mended(plain.local[0]).x.size(0) == graph.num_nodes


def test_neighgen_local_batch_gives_the_whole_graph_loss():
    """The generator's batch on the kept nodes only (fGen on those with a hidden neighbour)
    has the loss of the whole graph."""
    from fedlightning.methods.fedsage.fedsage_client import generator_loss

    torch.manual_seed(0)
    n, d = 12, 3
    x = torch.randn(n, d)
    ei = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 0, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
    ei = torch.cat([ei, ei.flip(0)], 1)  # node 11 has no edge
    nodes = torch.unique(ei.flatten())
    kept, _, imp, missing = impair(ei, nodes, n, 0.5, torch.Generator().manual_seed(3))
    assert missing.size(1) > 0 and imp.size(1) > 0
    gen = NeighGen(d, 4, 2)
    deg, feats = gen(x, imp)  # the whole graph, fGen on every node
    want = degree_loss(deg, missing, kept, 2) + greedy_feature_loss(feats, x, missing, kept)
    whole = {"x": x, "impaired": imp, "kept": kept, "missing": missing}
    local = local_batch(x, kept, imp, missing)
    assert local["x"].size(0) == len(kept) < n
    assert torch.allclose(generator_loss(gen, local), want, atol=1e-6)
    assert torch.allclose(generator_loss(gen, whole), want, atol=1e-6)


def test_link_loss_reads_the_gnn_states():
    """The client's views are z of the event's nodes (the GNN, not the bank's contexts)."""
    from fedlightning.methods.history.graph_task import ClientGraph, GraphTaskClient

    proto, graph = toy_world()
    net = FedGCNNet(4, 3, 2)
    client = GraphTaskClient(net, proto.stream, "lp")
    client.use_graph(ClientGraph(graph.x, torch.tensor([[0, 3], [3, 0]])))
    batch = {
        "events": torch.tensor([0, 2]),
        "neg_id": torch.tensor([4, -1]),
        "neg_ok": torch.tensor([True, False]),
        "y": torch.zeros(2, dtype=torch.long),
    }
    z = net(graph.x, client.graph.edge_index)
    pos = F.cosine_similarity(z[0], z[3], dim=0) / 0.1
    neg = F.cosine_similarity(z[0], z[4], dim=0) / 0.1
    want = torch.logaddexp(pos, neg) - pos  # event 1's negative failed: masked
    assert client.training_step(batch, 0).item() == pytest.approx(want.item(), rel=1e-5)


@pytest.mark.parametrize("net", [FedGCNNet(4, 3, 2), SageNet(4, 5, 3)])
def test_the_support_subgraph_gives_the_whole_graphs_states(net):
    """The client runs the GNN on its support's receptive field only: the same states."""
    from fedlightning.methods.history.graph_task import ClientGraph, GraphTaskClient, event_nodes

    proto, _ = toy_world()
    g = torch.Generator().manual_seed(1)
    ei = torch.randint(0, 30, (2, 80), generator=g)
    ei = torch.unique(torch.cat([ei, ei.flip(0)], 1), dim=1)
    x = torch.randn(30, 4, generator=g)
    stream = EventStream(
        "r", np.array([0, 5, 9]), np.array([12, 20, 29]), np.arange(3), 30, False,
        np.zeros(30, int),
    )  # fmt: skip
    client = GraphTaskClient(net, stream, "lp")
    client.use_graph(ClientGraph(x, ei))
    batch = {"events": torch.tensor([0, 1, 2]), "neg_id": torch.tensor([3, 7, 11])}
    batch.update(neg_ok=torch.ones(3, dtype=torch.bool), y=torch.zeros(3, dtype=torch.long))
    full = net(x, ei)
    u, i, _, j, _ = client.views(batch)
    nodes = event_nodes(stream.src, stream.dst, batch)
    for got, n in ((u, nodes[0]), (i, nodes[1]), (j, nodes[2])):
        assert torch.allclose(got[0], full[n], atol=1e-6)
    sub_x, _, _ = client.subgraph(nodes)
    assert sub_x.size(0) < 30 or net.hops == 2  # a field, not the graph (for one hop)
