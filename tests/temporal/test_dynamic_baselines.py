"""Feddy, STFL and FedDGL (FedTIP Table 2's dynamic baselines): every equation against a hand
computation or a reference implementation, and each method's defining mechanism."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedlightning.data.temporal.manifest import DOWN_VAL, PRETRAIN, PREVAL, SUP_POOL, TEST
from fedlightning.messages import ClientUpdate, ServerBroadcast
from fedlightning.methods.dynamic.dynamic_client import DynamicBaselineClient, prototype_gap
from fedlightning.methods.dynamic.dynamic_model import (
    FedDGLNet,
    FeddyNet,
    StackedGRU,
    STFLNet,
    evolve_weights,
    feddy_layer,
    gcn_mean,
    interaction_adjacency,
    knn_adjacency,
    mean_readout,
    sage_mean,
    trajectory_loss,
)
from fedlightning.methods.dynamic.snapshots import (
    SnapshotView,
    history_events,
    neighbour_means,
    recent_neighbours,
    snapshot_view,
)
from fedlightning.methods.feddgl.feddgl import FedDGL
from fedlightning.methods.feddgl.feddgl_server import (
    FedDGLServer,
    adaptive_margin,
    generator_loss,
    mixing_weights,
    personalise,
)
from fedlightning.methods.feddy.feddy import trajectory_samples
from fedlightning.methods.stfl.stfl import neighbour_inputs
from fedlightning.temporal.adapter import StackedLinear

# ------------------------------------------------------------------------- snapshot view


def test_neighbour_means_by_hand():
    states = torch.tensor([[1.0, 0.0], [0.0, 2.0], [4.0, 4.0], [9.0, 9.0]])
    # events 0->1, 0->2, 1->2 (twice): node 0 sees 1, 2; node 1 sees 0, 2, 2; node 2 sees 0, 1, 1
    m, d = neighbour_means(np.array([0, 0, 1, 1]), np.array([1, 2, 2, 2]), states)
    assert d.tolist() == [2, 3, 3, 0]
    assert torch.allclose(m[0], torch.tensor([2.0, 3.0]))
    assert torch.allclose(m[1], torch.tensor([9.0 / 3, 8.0 / 3]))
    assert torch.allclose(m[2], torch.tensor([1.0 / 3, 4.0 / 3]))
    assert m[3].tolist() == [0.0, 0.0]  # no neighbour in the window


def test_recent_neighbours_most_recent_distinct_first():
    # time order: 0-1, 0-2, 0-1, 3-0
    out = recent_neighbours(np.array([0, 0, 0, 3]), np.array([1, 2, 1, 0]), 4, 2)
    assert out[0].tolist() == [3, 1]  # 3 latest, then 1 (2 is older than the second 0-1)
    assert out[1].tolist() == [0, -1] and out[2].tolist() == [0, -1] and out[3].tolist() == [0, -1]


class CountingEncoder(torch.nn.Module):
    """A stand-in bank whose state of a node is the number of events it took part in."""

    def __init__(self, stream):
        super().__init__()
        self.state = SimpleNamespace(
            event_t=torch.from_numpy(stream.t), event_msg=torch.zeros(len(stream.t), 0)
        )
        self.count = torch.zeros(stream.num_nodes)
        self.seen: list[int] = []

    def reset_state(self):
        self.count = torch.zeros_like(self.count)
        self.seen = []

    def ingest(self, src, dst, t, msg, idx):
        self.count.index_add_(0, torch.cat([src, dst]), torch.ones(2 * len(src)))
        self.seen += idx.tolist()

    def embed(self, n_id, t):
        return self.count[n_id].unsqueeze(1).repeat(1, 2)


def tiny_stream_and_manifest():
    src = np.array([0, 1, 0, 2, 1, 0, 2, 1])
    dst = np.array([3, 3, 4, 4, 4, 3, 3, 4])
    stream = SimpleNamespace(src=src, dst=dst, t=np.arange(8), num_nodes=5)
    outcome = np.array([PRETRAIN] * 4 + [PREVAL, PREVAL, SUP_POOL, TEST], dtype=np.int8)
    return stream, SimpleNamespace(outcome=outcome)


def test_snapshot_view_streams_only_the_history_and_reads_states_at_window_ends():
    stream, manifest = tiny_stream_and_manifest()
    assert history_events(manifest).tolist() == [0, 1, 2, 3, 4, 5]
    bank = CountingEncoder(stream)
    bank.count += 100  # the bank's own state must not leak into the re-streamed view
    view = snapshot_view(bank, stream, manifest, windows=2, recent=2)
    assert bank.count[0] == 100  # the bank itself untouched (a fork streamed)
    assert view.bounds == [(0, 3), (3, 6)]
    # window 0: events 0-3, 1-3, 0-4; counts 0:2 1:1 2:0 3:2 4:1
    assert view.states[0, :, 0].tolist() == [2, 1, 0, 2, 1]
    assert view.states[1, :, 0].tolist() == [3, 2, 1, 3, 3]  # + 2-4, 1-4, 0-3
    assert view.degree[1].tolist() == [1, 1, 1, 1, 2]
    assert view.means[1, 4, 0].item() == pytest.approx((1 + 2) / 2)  # 2 and 1 at window end
    assert view.recent[3].tolist() == [0, 1]  # events 6 and 7 (candidate, test) never seen
    assert view.recent[4].tolist() == [1, 2]
    again = snapshot_view(CountingEncoder(stream), stream, manifest, windows=2, recent=2)
    assert again.hash == view.hash
    changed = snapshot_view(CountingEncoder(stream), stream, manifest, windows=3, recent=2)
    assert changed.hash != view.hash


def hand_view() -> SnapshotView:
    g = torch.Generator().manual_seed(0)
    states = torch.randn(4, 6, 3, generator=g)
    means = torch.randn(4, 6, 3, generator=g)
    degree = torch.tensor([[1.0, 0, 2, 1, 0, 0], [1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0], [1, 1, 0, 1, 0, 0]])  # fmt: skip
    recent = torch.tensor([[1, 2], [0, -1], [0, -1], [-1, -1], [1, 0], [-1, -1]])
    return SnapshotView(states, means, degree, recent, [(0, 1), (1, 2), (2, 3), (3, 4)])


# ---------------------------------------------------------------------------------- Feddy


def test_feddy_layer_and_trajectory_loss_by_hand():
    torch.manual_seed(0)
    w = [StackedLinear(1, 3, 4, bias=b) for b in (True, False, False)]
    s, m, p = torch.randn(1, 2, 3), torch.randn(1, 2, 3), torch.randn(1, 2, 3)
    (a0, b0), a_s, a_d = (w[0].weight[0], w[0].bias[0]), w[1].weight[0], w[2].weight[0]
    hand = torch.relu(s[0] @ a0.T + b0 + m[0] @ a_s.T + p[0] @ a_d.T)
    assert torch.allclose(feddy_layer(*w, s, m, p)[0], hand, atol=1e-6)
    pred = torch.tensor([[[1.0, 0.0], [0.0, 0.0], [5.0, 5.0]]])
    target = torch.tensor([[[0.0, 0.0], [0.0, 2.0], [0.0, 0.0]]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert trajectory_loss(pred, target, mask).item() == pytest.approx((1 + 4) / 2)


def test_trajectory_samples_read_the_current_previous_and_next_windows():
    view = hand_view()
    out = trajectory_samples(view, np.array([1, 2]), 10, seed=0)
    # pairs (w, v) with w in 1..2, degree > 0 at w and w+1: (1,1) (1,2) (2,1) (2,2): node 1 at
    # w=1 (1, then 1), node 2 at w=1 (1, then 1), node 1 at w=2 (1, then 1), node 2 at w=2 (1, 0: no)
    assert len(out["traj_s"]) == 3
    assert torch.equal(out["traj_s"][0], view.states[1, 1])
    assert torch.equal(out["traj_p"][0], view.means[0, 1])
    assert torch.equal(out["traj_next"][0], view.means[2, 1])
    assert len(trajectory_samples(view, np.array([1, 2]), 2, seed=0)["traj_m"]) == 2


def feddy_batch(k: int = 2, n: int = 6, d: int = 4, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    b = {key: torch.randn(k, n, d, generator=g) for key in ("h_u", "h_i", "h_j")}
    for side in "uij":
        b[f"m_{side}"] = torch.randn(k, n, d, generator=g)
        b[f"p_{side}"] = torch.randn(k, n, d, generator=g)
        b[f"d_{side}"] = torch.randint(0, 3, (k, n), generator=g).float()
        b[f"nb_{side}"] = torch.randn(k, n, 2, d, generator=g)
        b[f"nm_{side}"] = torch.tensor([True, False]).expand(k, n, 2)
    b["y"] = torch.randint(0, 2, (k, n), generator=g)
    b["mask"] = torch.ones(k, n, dtype=torch.bool)
    b["neg_ok"] = torch.ones(k, n, dtype=torch.bool)
    return b


def traj_extras(k: int = 2, d: int = 4) -> dict:
    g = torch.Generator().manual_seed(1)
    out = {key: torch.randn(k, 5, d, generator=g) for key in ("traj_s", "traj_m", "traj_p")}
    out["traj_next"] = torch.randn(k, 5, d, generator=g) * 3
    out["traj_mask"] = torch.ones(k, 5)
    return out


def fit_steps(client, batch, steps=5):
    opt = client.configure_optimizers()
    for _ in range(steps):
        opt.zero_grad()
        client.loss(batch).backward()
        opt.step()


def test_feddy_trajectory_term_changes_the_fit():
    """Without the trajectory term, the head P gets no gradient and the shared layers fit
    another objective: the trained models differ."""
    torch.manual_seed(0)
    net = FeddyNet(4, hidden=8)
    start = net.copy_state(0)
    fits = {}
    for lam in (0.0, 1.0):
        client = DynamicBaselineClient(FeddyNet(4, hidden=8), "lp", lambda_traj=lam, lr=1e-2)
        client.receive([start, start], traj_extras())
        fit_steps(client, feddy_batch())
        fits[lam] = client.net.copy_state(0)
    assert torch.equal(fits[0.0]["traj.weight"], start["traj.weight"])  # untouched
    assert not torch.equal(fits[1.0]["traj.weight"], start["traj.weight"])
    assert not torch.allclose(fits[0.0]["w_0.weight"], fits[1.0]["w_0.weight"])


def test_feddy_reads_the_previous_snapshot():
    torch.manual_seed(0)
    net = FeddyNet(4, hidden=8)
    b = feddy_batch(k=1)
    before = net.represent(b, "i")
    b["p_u"] = b["p_u"] + 1.0
    assert not torch.allclose(before, net.represent(b, "i"))


# ----------------------------------------------------------------------------------- STFL


def test_stfl_event_graph_holds_the_endpoints_recent_neighbours():
    view = hand_view()
    nodes = {"u": torch.tensor([0, 3]), "i": torch.tensor([4, 1])}
    out = neighbour_inputs(view, nodes)
    # node 0's recent neighbours 1, 2 with the last window's states
    assert torch.equal(out["nb_u"][0], view.states[-1][[1, 2]])
    assert out["nm_u"][0].tolist() == [True, True]
    assert out["nm_u"][1].tolist() == [False, False] and out["nb_u"][1].abs().sum() == 0
    assert torch.equal(out["nb_i"][0], view.states[-1][[1, 0]])
    assert out["nm_i"][1].tolist() == [True, False]


def test_interaction_and_knn_adjacency_by_hand():
    a = interaction_adjacency(torch.tensor([True, False]), torch.tensor([True, True]))
    # nodes: u, v, nb_u0, nb_u1, nb_v0, nb_v1
    expected = {(0, 1), (0, 2), (1, 4), (1, 5)}
    for i in range(6):
        for j in range(6):
            assert bool(a[i, j]) == ((i, j) in expected or (j, i) in expected)
    x = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
    ok = torch.tensor([True, True, True, False])
    k = knn_adjacency(x, ok, 1)
    # 0 -> 1, 1 -> 0, 2 -> 1 (cos 0.11 beats 0), made symmetric
    assert k.tolist() == [
        [False, True, False, False],
        [True, False, True, False],
        [False, True, False, False],
        [False, False, False, False],
    ]
    assert not k[3].any() and not k[:, 3].any()  # an invalid node joins no edge
    assert torch.equal(k, k.T)


def test_sage_mean_and_readout_by_hand():
    torch.manual_seed(0)
    root, nbr = StackedLinear(1, 2, 3), StackedLinear(1, 2, 3, bias=False)
    x = torch.randn(1, 1, 3, 2)
    adj = torch.tensor([[[[False, True, True], [True, False, False], [True, False, False]]]])
    out = sage_mean(root, nbr, x, adj)[0, 0]
    xs = x[0, 0]
    w_r, b_r, w_n = root.weight[0], root.bias[0], nbr.weight[0]
    hand0 = torch.relu(xs[0] @ w_r.T + b_r + ((xs[1] + xs[2]) / 2) @ w_n.T)
    hand1 = torch.relu(xs[1] @ w_r.T + b_r + xs[0] @ w_n.T)
    assert torch.allclose(out[0], hand0, atol=1e-6) and torch.allclose(out[1], hand1, atol=1e-6)
    h = torch.tensor([[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]])
    assert mean_readout(h, torch.tensor([True, True, False])).tolist() == [2.0, 3.0]


def test_stfl_score_depends_on_the_neighbours():
    """Remove the per-event graph's neighbours and the event's score changes."""
    torch.manual_seed(0)
    net = STFLNet(4, hidden=8)
    b = feddy_batch(k=1)
    with_nb = net.represent(b, "i")
    b["nm_u"] = torch.zeros_like(b["nm_u"])
    b["nm_i"] = torch.zeros_like(b["nm_i"])
    assert not torch.allclose(with_nb, net.represent(b, "i"))


# --------------------------------------------------------------------------------- FedDGL


def test_stacked_gru_equals_torch_gru_cell_and_evolves_the_weights():
    torch.manual_seed(0)
    ours = StackedGRU(1, 4)
    ref = torch.nn.GRUCell(4, 4)
    with torch.no_grad():
        ref.weight_ih.copy_(ours.x.weight[0])
        ref.bias_ih.copy_(ours.x.bias[0])
        ref.weight_hh.copy_(ours.h.weight[0])
        ref.bias_hh.copy_(ours.h.bias[0])
    w0 = torch.randn(1, 3, 4)
    assert torch.allclose(ours(w0, w0)[0], ref(w0[0], w0[0]), atol=1e-6)
    w = w0[0]
    for _ in range(3):
        w = ref(w, w)
    assert torch.allclose(evolve_weights(w0, ours, 3)[0], w, atol=1e-5)


def previous_feddgl_views(net: FedDGLNet, b: dict, family: str) -> tuple:
    """The earlier FedDGL forward: the GRU cell called ``windows`` times with input = hidden
    (two ``3H`` maps per step), then each side's node on its own."""
    w = net.w0
    for _ in range(net.windows):
        w = net.gru(w, w)

    def node(side):
        return net.node(b[f"h_{side}"], b[f"m_{side}"], b[f"d_{side}"], w)

    if family == "nc":
        return node("u"), b["y"], b["mask"]
    return node("u"), node("i"), node("u"), node("j"), b["mask"] & b["neg_ok"]


@pytest.mark.parametrize("family", ["lp", "nc"])
def test_fused_feddgl_forward_equals_the_previous_one_with_its_gradients(family):
    """The fused evolution (summed r/z gate weights, one product per step, built once per
    call) and the sides in one product: the same views and gradients up to float rounding."""
    torch.manual_seed(0)
    net = FedDGLNet(4, hidden=6, windows=10, copies=3)
    with torch.no_grad():  # non-trivial gates: biases away from zero
        for p in net.gru.parameters():
            p.add_(0.3 * torch.randn_like(p))
    b = feddy_batch(k=3)
    reference = previous_feddgl_views(net, b, family)
    grads = []
    for views in (net.views, lambda x, f: previous_feddgl_views(net, x, f)):
        net.zero_grad()
        v = views(b, family)
        for got, want in zip(v, reference, strict=True):
            assert torch.allclose(got, want, atol=1e-6), family
        reps = [t for t in v if t.requires_grad]
        sum((i + 1) * t.square().sum() for i, t in enumerate(reps)).backward()
        grads.append({n: p.grad.clone() for n, p in net.named_parameters()})
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4), name
    gru_ref = net.w0
    for _ in range(10):
        gru_ref = net.gru(gru_ref, gru_ref)
    assert torch.allclose(evolve_weights(net.w0, net.gru, 10), gru_ref, atol=1e-6)
    assert not torch.allclose(evolve_weights(net.w0, net.gru, 9), gru_ref, atol=1e-3)


@pytest.mark.parametrize("family", ["lp", "nc"])
def test_fused_feddgl_trains_as_the_previous_one_in_double_precision(family):
    """30 Adam steps of the family loss with either forward from the same start: in float64
    the models agree (a float32 run differs only by the rounding Adam amplifies)."""
    from fedlightning.clients.temporal_prompt import task_loss

    torch.manual_seed(0)
    start = FedDGLNet(4, hidden=6, windows=10, copies=2).double()
    b = {k: v.double() if v.is_floating_point() else v for k, v in feddy_batch(k=2).items()}
    fitted = []
    for views in ("fused", "previous"):
        net = FedDGLNet(4, hidden=6, windows=10, copies=2).double()
        net.load_state_dict(start.state_dict())
        opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        for _ in range(30):
            opt.zero_grad()
            v = net.views(b, family) if views == "fused" else previous_feddgl_views(net, b, family)
            task_loss(v, family, 0.1).backward()
            opt.step()
        fitted.append(torch.cat([p.reshape(-1) for p in net.parameters()]))
    assert not torch.allclose(fitted[0], torch.cat([p.reshape(-1) for p in start.parameters()]))
    assert torch.allclose(fitted[0], fitted[1], atol=1e-9, rtol=0)


def test_gcn_mean_and_feddgl_uses_the_evolved_weights():
    s, m = torch.tensor([[1.0, 1.0]]), torch.tensor([[4.0, 0.0]])
    assert gcn_mean(s, m, torch.tensor([3.0])).tolist() == [[13 / 4, 1 / 4]]
    torch.manual_seed(0)
    net = FedDGLNet(4, hidden=6, windows=3)
    b = feddy_batch(k=1)
    z = net.views(b, "nc")[0]
    w = evolve_weights(net.w0, net.gru, 3)
    hand = net.dec(torch.relu(torch.bmm(gcn_mean(b["h_u"], b["m_u"], b["d_u"]), w)))
    assert torch.allclose(z, hand)
    net.windows = 2  # one evolution fewer: another representation
    assert not torch.allclose(net.views(b, "nc")[0], z)


def test_prototype_gap_by_hand():
    q = torch.tensor([[[0.0, 0.0], [3.0, 4.0]], [[1.0, 0.0], [0.0, 0.0]]])
    counts = torch.tensor([[2, 1], [1, 0]])
    glob = torch.zeros(2, 2)
    has = torch.tensor([True, True])
    # client 0: (0 + 5) / 2; client 1: its one class 0: 1
    assert prototype_gap(q, counts, glob, has).item() == pytest.approx(3.5)
    assert prototype_gap(q, counts, glob, torch.tensor([True, False])).item() == pytest.approx(1.0)


def test_adaptive_margin_and_generator_loss_by_hand():
    means = {0: torch.tensor([0.0, 0.0]), 1: torch.tensor([3.0, 4.0]), 2: torch.tensor([0.0, 1.0])}
    assert adaptive_margin(means) == pytest.approx(5.0)
    assert adaptive_margin(means, cap=2.0) == 2.0
    assert adaptive_margin({1: torch.ones(2)}) == 0.0  # single class: no gap
    q = torch.tensor([[0.0, 0.0]])
    glob = torch.tensor([[3.0, 4.0], [0.0, 1.0]])
    # true class 0 at distance 5 (+ margin 1), the other at 1
    hand = -math.log(math.exp(-6) / (math.exp(-6) + math.exp(-1)))
    assert generator_loss(q, torch.tensor([0]), glob, 1.0).item() == pytest.approx(hand, rel=1e-5)


def test_mixing_weights_follow_the_cosine():
    glob = {0: torch.tensor([1.0, 0.0]), 1: torch.tensor([0.0, 1.0])}
    clients = [
        {0: torch.tensor([1.0, 0.0]), 1: torch.tensor([0.0, 1.0])},  # cos 1
        {0: torch.tensor([0.0, 1.0]), 1: torch.tensor([1.0, 0.0])},  # cos 0
        {1: torch.tensor([0.0, -2.0])},  # single class: cos -1 on its class only
        {},  # nothing shared: cos 0
    ]
    w = mixing_weights(clients, glob, 0.5)
    e = [math.exp(0.5 * c) for c in (1, 0, -1, 0)]
    assert w == pytest.approx([x / sum(e) for x in e])
    assert personalise(torch.tensor([2.0]), torch.tensor([4.0]), 0.25).item() == 2.5


def proto_update(k: int, protos: dict, n: int = 3, d: int = 2) -> ClientUpdate:
    return ClientUpdate(
        round=1,
        client_id=k,
        tensors={
            "delta": torch.full((d,), float(k)),
            **{f"proto.{c}": q for c, q in protos.items()},
        },  # fmt: skip
        scalars={f"count.{c}": float(n) for c in protos},
    )


def test_feddgl_server_weights_clients_by_their_prototypes_cosine():
    torch.manual_seed(0)
    server = FedDGLServer({"w": torch.zeros(2)}, d=2, gen_steps=100, gen_lr=0.05)
    a, b = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 2.0])
    updates = [
        proto_update(0, {0: a, 1: b}),
        proto_update(1, {0: a + 0.1, 1: b - 0.1}),
        proto_update(2, {0: a - 0.1, 1: b + 0.1}),
        proto_update(3, {0: b, 1: a}),  # swapped: far from the global prototypes
    ]
    server.aggregate(1, updates)
    glob = server.global_prototypes()
    mean0, mean1 = (3 * a + b) / 4, (3 * b + a) / 4
    assert set(glob) == {0, 1} and server.margin == pytest.approx(float((mean0 - mean1).norm()))
    protos = [{c: u.tensors[f"proto.{c}"] for c in (0, 1)} for u in updates]
    assert [server.mix[k] for k in range(4)] == pytest.approx(mixing_weights(protos, glob))
    assert min(server.mix[k] for k in range(3)) > server.mix[3]
    assert torch.allclose(server.state()["w"], torch.full((2,), 1.5))  # FedAvg of deltas
    sent = server.broadcast(2)
    assert sent.scalars["mix.3"] == server.mix[3] and "glob.1" in sent.tensors


def test_feddgl_server_guards_single_class_rounds():
    server = FedDGLServer({"w": torch.zeros(2)}, d=2)
    before = [p.clone() for p in server.generator.parameters()]
    server.aggregate(1, [proto_update(0, {1: torch.ones(2)}), proto_update(1, {1: torch.ones(2)})])
    assert server.margin == 0.0 and not server.trained and server.global_prototypes() == {}
    assert all(
        torch.equal(p, q) for p, q in zip(before, server.generator.parameters(), strict=True)
    )
    assert set(server.mix.values()) == {0.0}
    assert set(server.class_prototypes()) == {1}  # the uploads' mean while untrained


def test_feddgl_clients_start_from_their_personalised_mixture():
    alg = FedDGL()
    net = FedDGLNet(2, hidden=2, windows=1)
    client = DynamicBaselineClient(net, "lp")
    p = net.num_values()
    omega = torch.zeros(p)
    alg.personal = {7: torch.ones(p)}
    sent = ServerBroadcast(round=2, tensors={"model": omega}, scalars={"mix.7": 0.25})
    starts = alg.starts(sent, client, [7, 8])
    flat = [torch.cat([v.reshape(-1) for v in s.values()]) for s in starts]
    assert torch.allclose(flat[0], torch.full((p,), 0.25))  # (1 - w) * 0 + w * 1
    assert torch.equal(flat[1], omega)  # no own model yet: the FedAvg one


def test_feddgl_uplink_carries_prototypes_for_both_families():
    alg = FedDGL()
    assert "prototypes" in alg.message_fields("lp") and "prototypes" in alg.message_fields("nc")
    net = FedDGLNet(4, hidden=4, windows=2)
    assert alg.message_size(net, "lp") == net.num_values() + 2 + 2 * 4


def test_prototype_term_pulls_client_prototypes_to_the_global_ones():
    torch.manual_seed(0)
    net = FedDGLNet(4, hidden=6, windows=2)
    start = net.copy_state(0)
    b = feddy_batch(k=1)
    glob = torch.zeros(2, 4)
    gaps = {}
    for lam in (0.0, 1.0):
        client = DynamicBaselineClient(FedDGLNet(4, hidden=6, windows=2), "nc", lambda_proto=lam, lr=1e-2)  # fmt: skip
        client.receive([start], {"glob": glob, "has_glob": torch.tensor([True, True])})
        fit_steps(client, b, steps=20)
        q, counts = client.prototypes(b)
        gaps[lam] = prototype_gap(q, counts, glob, torch.tensor([True, True])).item()
    assert gaps[1.0] < gaps[0.0]


def test_views_match_the_protocol_scorer_layout():
    torch.manual_seed(0)
    b = feddy_batch(k=1)
    for net in (FeddyNet(4, 8), STFLNet(4, 8), FedDGLNet(4, 8, 2)):
        v = net.views(b, "lp")
        assert len(v) == 5 and v[0].shape == (1, 6, 4) and v[1].shape == (1, 6, 4)
        assert F.cosine_similarity(v[0], v[1], dim=-1).shape == (1, 6)
        assert net.views(b, "nc")[0].shape == (1, 6, 4)


@pytest.mark.parametrize("outcome", [DOWN_VAL])
def test_history_excludes_downstream_segments(outcome):
    _, manifest = tiny_stream_and_manifest()
    manifest.outcome[0] = outcome
    assert 0 not in history_events(manifest).tolist()
