"""FedTIP's client module, its messages and the per-task loop, against hand computations."""

import math

import pytest
import torch
import torch.nn.functional as F

from fedlightning.clients.temporal_prompt import as_single, family_views, stack_batches
from fedlightning.clients.temporal_prompt import score_segment as evaluate
from fedlightning.federation.executors import LeanExecutor
from fedlightning.federation.runners import SequentialRunner
from fedlightning.federation.task_loop import TaskBatches, TaskLoop
from fedlightning.methods.fedtip.fedtip import FedTIP
from fedlightning.metrics.temporal import auroc, class_score, link_auroc
from fedlightning.server.reliability import read_update

D_H, D_T, D_E = 4, 3, 2


def client_batch(n, seed, labels=None):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {
        "h_u": r(n, D_H),
        "h_i": r(n, D_H),
        "h_j": r(n, D_H),
        "te": r(n, D_T),
        "x": r(n, D_E),
        "r_u": r(n).abs(),
        "r_i": r(n).abs(),
        "r_j": r(n).abs(),
        "y": torch.tensor(labels) if labels is not None else torch.arange(n) % 2,
        "neg_ok": torch.ones(n, dtype=torch.bool),
        "inductive": torch.zeros(n, dtype=torch.bool),
    }


def by_hand_loss(adapter, b, family, tau, lam_p, start, lam_a, anchors):
    """Eq. (26) for one unstacked client, written out with plain torch."""
    h = adapter(b["h_u"], b["h_i"], b["te"], b["x"], b["r_u"], b["r_i"])
    if family == "lp":
        hn = adapter(b["h_u"], b["h_j"], b["te"], b["x"], b["r_u"], b["r_j"])
        pos = F.cosine_similarity(h, b["h_i"], dim=-1) / tau
        neg = F.cosine_similarity(hn, b["h_j"], dim=-1) / tau
        task = -(pos - torch.log(pos.exp() + neg.exp())).sum()
        protos = {1: h.mean(0), 0: hn.mean(0)}
        counts = {1: len(h), 0: len(h)}
    else:
        y = b["y"]
        protos = {int(c): h[y == c].mean(0) for c in y.unique()}
        counts = {c: int((y == c).sum()) for c in protos}
        classes = sorted(protos)
        task = 0.0
        for e in range(len(h)):
            s = torch.stack([F.cosine_similarity(h[e], protos[c], dim=0) / tau for c in classes])
            task = task - (s[classes.index(int(y[e]))] - torch.logsumexp(s, 0))
    prox = sum(((p - start[n][0]) ** 2).sum() for n, p in adapter.named_parameters())
    n = sum(counts.values())
    anchor = sum(
        counts[c] / n * (1 - F.cosine_similarity(q, anchors[c], dim=0))
        for c, q in protos.items()
        if c in anchors
    )
    return task + lam_p * prox + lam_a * anchor


@pytest.mark.parametrize("family", ["nc", "lp"])
def test_stacked_client_loss_is_the_sum_of_each_clients_eq26(family):
    torch.manual_seed(0)
    alg = FedTIP(dropout=0.0, lambda_p=0.5, lambda_a=0.3)
    single = alg.adapter(D_H, D_T, D_E)
    omega = {k: v.clone() for k, v in single.state_dict().items()}
    module = alg.task_module(single, family)
    anchors = {1: torch.tensor([1.0, 0.0, 0.0, 0.0])}  # class 0 has no anchor yet: skipped
    batches = [client_batch(5, 1, [0, 1, 1, 0, 1]), client_batch(3, 2, [1, 1, 0])]
    module.receive(omega, anchors, copies=2)
    with torch.no_grad():  # move the copies apart so the proximal term is not zero
        for p in module.adapter.parameters():
            p.add_(0.1 * torch.randn_like(p))
    loss = module.training_step(stack_batches(batches), 0)
    expected = 0.0
    for k, b in enumerate(batches):
        mine = alg.adapter(D_H, D_T, D_E)
        mine.load_state_dict(module.adapter.copy_state(k))
        expected = expected + by_hand_loss(mine, b, family, 0.1, 0.5, omega, 0.3, anchors)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_one_stacked_fit_equals_separate_fits():
    """K clients trained together follow exactly their own gradients (Adam is element-wise)."""
    torch.manual_seed(0)
    alg = FedTIP(dropout=0.0)
    omega = alg.adapter(D_H, D_T, D_E).state_dict()
    anchors = {0: torch.ones(D_H), 1: -torch.ones(D_H)}
    batches = [client_batch(6, 3), client_batch(4, 4), client_batch(5, 5)]
    together = alg.task_module(alg.adapter(D_H, D_T, D_E), "lp")
    together.receive(omega, anchors, copies=3)
    LeanExecutor().fit(together, stack_batches(batches), epochs=5)
    for k, b in enumerate(batches):
        alone = alg.task_module(alg.adapter(D_H, D_T, D_E), "lp")
        alone.receive(omega, anchors, copies=1)
        LeanExecutor().fit(alone, stack_batches([b]), epochs=5)
        got = together.adapter.copy_state(k)
        for name, p in alone.adapter.named_parameters():
            assert torch.allclose(got[name], p.detach(), atol=1e-6), name
        assert not torch.allclose(got["psi.1.bias"], omega["psi.1.bias"])  # it did train


def test_message_fields_and_values_eq2():
    torch.manual_seed(0)
    alg = FedTIP(dropout=0.0)
    adapter = alg.adapter(D_H, D_T, D_E)
    omega = {k: v.clone() for k, v in adapter.state_dict().items()}
    module = alg.task_module(adapter, "nc")
    batches = [client_batch(4, 1, [1, 1, 1, 0]), client_batch(3, 2, [1, 1, 1])]
    stack = stack_batches(batches)
    module.receive(omega, {}, copies=2)
    LeanExecutor().fit(module, stack, epochs=2)
    u0, u1 = alg.make_updates(module, stack, omega, round=1, client_ids=[7, 9])
    assert set(u0.tensors) == {"delta", "proto.0", "proto.1"}
    assert set(u0.scalars) == {"count.0", "count.1", "coverage", "norm"}
    assert set(u1.tensors) == {"delta", "proto.1"} and set(u1.scalars) == {
        "count.1",
        "coverage",
        "norm",
    }
    assert u0.client_id == 7 and u1.scalars["count.1"] == 3.0
    # b_k = 1 - (|3/4 - 1/2| + |1/4 - 1/2|) / 2 = 0.75; a one-class client: 0.5
    assert u0.scalars["coverage"] == pytest.approx(0.75) and u1.scalars["coverage"] == 0.5
    state0 = module.adapter.copy_state(0)
    delta = torch.cat([(state0[n] - omega[n]).reshape(-1) for n in omega])
    assert torch.allclose(u0.tensors["delta"], delta) and u0.scalars["norm"] == pytest.approx(
        float(delta.norm())
    )
    mine = alg.adapter(D_H, D_T, D_E)
    mine.load_state_dict(state0)
    mine.eval()
    h = mine(*(batches[0][k] for k in ("h_u", "h_i", "te", "x", "r_u", "r_i")))
    assert torch.allclose(u0.tensors["proto.0"], h[3], atol=1e-6)
    assert torch.allclose(u0.tensors["proto.1"], h[:3].mean(0), atol=1e-6)
    assert u0.num_values() == alg.message_size(adapter, "nc")  # the hand count
    s = read_update(u0)
    assert s.counts == {0: 1, 1: 3} and s.size == 4 and set(s.prototypes) == {0, 1}
    # the FedAvg prompt on link prediction: the delta and the counts, nothing else
    fedavg = FedTIP(dropout=0.0, aggregation="fedavg", anchors=False)
    lp = fedavg.task_module(fedavg.adapter(D_H, D_T, D_E), "lp")
    lp.receive(omega, {}, copies=1)
    (v,) = fedavg.make_updates(lp, stack_batches(batches[:1]), omega, 1, [0])[:1]
    assert set(v.tensors) == {"delta"} and set(v.scalars) == {"count.0", "count.1"}


def tiny_loop(alg, rounds=3, families=("nc", "lp"), **kw):
    tasks = [
        TaskBatches(0, {2: client_batch(5, 1), 4: client_batch(6, 2), 5: client_batch(5, 3)}),
        TaskBatches(1, {2: client_batch(6, 4), 3: client_batch(4, 5)}),
    ]
    evals = {"val": as_single(client_batch(40, 8)), "test": as_single(client_batch(60, 9))}
    return TaskLoop(
        alg,
        tasks,
        evals,
        list(families),
        (D_H, D_T, D_E),
        SequentialRunner(LeanExecutor(), progress=False),
        rounds=rounds,
        epochs=2,
        seed=3,
        bank_values=1000,
        progress=False,
        **kw,
    )


def test_task_loop_ledger_matches_the_hand_count_eqs32_33():
    alg = FedTIP()
    loop = tiny_loop(alg)
    results = loop.run()
    p = alg.adapter(D_H, D_T, D_E).num_values()
    msg = p + 2 * D_H + 2 + 2  # delta, two prototypes and counts, coverage and norm
    comm = loop.comm()
    # every client's latest message, per family (clients 4 and 5 took part in task 0 only)
    latest = {str(k): msg for k in (2, 3, 4, 5)}
    assert comm["message_values_per_client"] == {"nc": latest, "lp": latest}
    assert comm["message_values"] == {"nc": msg, "lp": msg}
    # task 0: 3 clients x 3 rounds x 2 families messages up
    assert results[0]["uplink_mib"] == pytest.approx(4 * 3 * 3 * 2 * msg / 1024**2)
    # down: the bank once per new client, then the adapter and the anchors to every active
    # client and round (no anchors before the first aggregate; both classes after it)
    adapter_down = 3 * 2 * (3 * p + 2 * 2 * D_H)
    assert results[0]["downlink_mib"] == pytest.approx(4 * (3 * 1000 + adapter_down) / 1024**2)
    # task 1: client 2 already holds the bank
    down1 = 1 * 1000 + 2 * 2 * (3 * p + 2 * 2 * D_H)
    assert results[1]["downlink_mib"] == pytest.approx(4 * down1 / 1024**2)
    assert comm["fields"]["nc/delta"]["up"] == 5 * 3 * p and comm["clients_provisioned"] == 4
    # one ledger: per client, per round; the per-task totals are derived from it
    assert comm["per_task"]["0"]["up"] == 3 * 3 * 2 * msg
    assert comm["per_client"]["3"]["up"] == 1 * 3 * 2 * msg  # client 3 is in task 1 only
    assert loop.ledger.total("up", round=1, scope="task=1", client=2) == 2 * msg
    assert comm["uplink_mib_per_task"] == pytest.approx(
        (results[0]["uplink_mib"] + results[1]["uplink_mib"]) / 2
    )
    # the recurrent downlink (Sec. 5.4): adapter and anchors, without the bank's 4 sends
    recurrent = (adapter_down + 2 * 2 * (3 * p + 2 * 2 * D_H)) / 2
    assert comm["recurrent_downlink_mib_per_task"] == pytest.approx(4 * recurrent / 1024**2)
    final = loop.final_metrics()
    for k in ("auc_nc", "auc_tlp", "auc_ilp", "val_auc_nc", "val_auc_tlp"):
        vals = [r[k] for r in results if not math.isnan(r[k])]
        if vals:
            assert final[k] == pytest.approx(sum(vals) / len(vals))


def test_task_loop_is_deterministic_and_resumes(tmp_path):
    a = tiny_loop(FedTIP()).run()
    b = tiny_loop(FedTIP()).run()

    def strip(rs):  # NaN (no inductive event here) compares equal to itself as None
        return [{k: None if v != v else v for k, v in r.items() if k != "task_time_s"} for r in rs]

    assert strip(a) == strip(b)
    first = tiny_loop(FedTIP(), checkpoint_path=tmp_path / "ck.pt")
    first.tasks = first.tasks[:1]  # stop after the first task, as a killed run would
    first.run()
    resumed = tiny_loop(FedTIP())
    resumed.load_state_dict(torch.load(tmp_path / "ck.pt", weights_only=False))
    assert strip(resumed.run()) == strip(a)


def test_switches_change_only_their_mechanism():
    base = tiny_loop(FedTIP(), families=("lp",)).run()
    no_rwa = tiny_loop(FedTIP(aggregation="fedavg"), families=("lp",))
    no_rwa.run()
    fields = no_rwa.ledger.by("field")
    assert "lp/coverage" not in fields and "lp/proto.1" in fields
    no_pa = tiny_loop(FedTIP(anchors=False), families=("lp",))
    no_pa.run()
    assert not any(k.startswith("lp/anchor") for k in no_pa.ledger.by("field"))
    central = tiny_loop(FedTIP(mode="central", anchors=False), families=("lp",))
    assert central.pooled  # pooled training: declared by the method, run by the one loop
    central.run()
    assert central.ledger.by("field") == {} and central.comm()["uplink_values"] == 0
    assert FedTIP(prompt="static").variant() == "no_icp"
    assert FedTIP(anchors=False, aggregation="fedavg").variant() == "no_pa_rwa"
    assert FedTIP().variant(pretrained_bank=False) == "no_tkb"
    assert FedTIP(name="prompt_fedavg", anchors=False, aggregation="fedavg").variant() == "full"
    assert base[0]["auc_tlp"] == base[0]["auc_tlp"]  # a number, not NaN


def test_server_scores_by_hand():
    h = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    q = {1: torch.tensor([1.0, 0.0]), 0: torch.tensor([0.0, 2.0])}
    s = class_score(h, q)  # cos to q1 minus cos to q0
    assert torch.allclose(s, torch.tensor([1.0, -1.0, 0.0]), atol=1e-6)
    # AUC: fraction of (positive, negative) pairs ranked right, ties one half
    assert auroc(torch.tensor([0.9, 0.1, 0.5, 0.5]), torch.tensor([1, 0, 1, 0])) == pytest.approx(
        (1 + 1 + 1 + 0.5) / 4
    )
    assert math.isnan(auroc(torch.tensor([0.3, 0.4]), torch.tensor([1, 1])))
    hi = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    # positives: cos 1 and 0; negatives: cos 0.5 and -1 -> pairs right: 1>0.5, 1>-1, 0>-1
    pos = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    neg = torch.tensor([[1.0, math.sqrt(3)], [-1.0, 0.0]])
    assert link_auroc(pos, hi, neg, hi) == pytest.approx(3 / 4)


def test_evaluate_reads_the_inductive_flags():
    torch.manual_seed(0)
    adapter = FedTIP(dropout=0.0).adapter(D_H, D_T, D_E)
    b = client_batch(30, 1)
    b["inductive"] = torch.arange(30) < 10
    b["neg_ok"][5] = False  # no negative: left out of both link AUCs
    out = evaluate(adapter, {}, as_single(b), "lp")
    views = family_views(adapter, as_single(b), "lp")
    ok = b["neg_ok"]
    ind = ok & b["inductive"]
    h_pos, h_i, h_neg, h_j = (v[0] for v in views[:4])
    assert out["auc_tlp"] == pytest.approx(link_auroc(h_pos[ok], h_i[ok], h_neg[ok], h_j[ok]))
    assert out["auc_ilp"] == pytest.approx(link_auroc(h_pos[ind], h_i[ind], h_neg[ind], h_j[ind]))
    assert out["auc_ilp"] != out["auc_tlp"]


def test_clipped_prototype_release_eq7_in_the_message():
    torch.manual_seed(0)
    omega = FedTIP(dropout=0.0).adapter(D_H, D_T, D_E).state_dict()
    batch = stack_batches([client_batch(6, 1, [1, 1, 1, 0, 0, 0])])
    plain, clipped = FedTIP(dropout=0.0), FedTIP(dropout=0.0, clip=0.05, sigma=0.0)
    out = {}
    for name, alg in (("plain", plain), ("clipped", clipped)):
        module = alg.task_module(alg.adapter(D_H, D_T, D_E), "nc")
        module.receive(omega, {}, copies=1)
        (u,) = alg.make_updates(module, batch, omega, 1, [0])
        out[name] = u
    views = family_views(module.adapter, batch, "nc")
    h1 = views[0][0][:3]
    scale = (0.05 / h1.norm(dim=-1, keepdim=True)).clamp(max=1.0)
    assert torch.allclose(out["clipped"].tensors["proto.1"], (h1 * scale).mean(0), atol=1e-6)
    assert out["clipped"].tensors["proto.1"].norm() <= 0.05 + 1e-6
    assert torch.allclose(out["plain"].tensors["proto.1"], h1.mean(0), atol=1e-6)
    noisy = FedTIP(dropout=0.0, clip=0.05, sigma=1.0)
    module = noisy.task_module(noisy.adapter(D_H, D_T, D_E), "nc")
    module.receive(omega, {}, copies=1)
    g = torch.Generator().manual_seed(0)
    (u,) = noisy.make_updates(module, batch, omega, 1, [0], [g])
    # Delta_2 = 2 C / n = 0.1 / 3: N(0, (sigma Delta_2)^2) per coordinate, class 0 drawn first
    ref = torch.Generator().manual_seed(0)
    torch.randn(D_H, generator=ref)
    expected = (h1 * scale).mean(0) + 0.1 / 3 * torch.randn(D_H, generator=ref)
    assert torch.allclose(u.tensors["proto.1"], expected.detach(), atol=1e-6)


def test_a_task_stack_is_built_once_and_equals_a_fresh_one():
    """``FedTIP.support_stack`` keeps a task share's padded stack across rounds and
    families: the kept stack equals a fresh ``stack_batches`` and another share or task
    gets its own."""
    alg = FedTIP()
    task = TaskBatches(7, {k: client_batch(4 + k, k) for k in (3, 5, 9)})
    first = alg.support_stack(task, [3, 5, 9])
    fresh = stack_batches([task.clients[k] for k in (3, 5, 9)], task.longest)
    assert first.keys() == fresh.keys()
    assert all(torch.equal(first[k], fresh[k]) for k in fresh)
    assert alg.support_stack(task, [3, 5, 9]) is first  # the next round reads the same
    part = alg.support_stack(task, [5, 9])  # another share: padded to the task's longest
    assert part["h_u"].shape == (2, 13, D_H) and torch.equal(
        part["mask"].sum(1), torch.tensor([9, 13])
    )
    other = TaskBatches(8, {k: client_batch(3, 10 + k) for k in (3, 5, 9)})
    assert not torch.equal(alg.support_stack(other, [3, 5, 9])["h_u"][0, :3], first["h_u"][0, :3])


@pytest.mark.parametrize("family", ["nc", "lp"])
def test_a_fit_builds_its_batch_inputs_once_and_they_give_the_same_views(family):
    """``FedTIPClient.inputs_of``: the event contexts and class masks of a batch are built
    once for the steps that read its tensors (each step gets a shallow copy), rebuilt for
    another batch, and the views and prototypes from them equal those built without."""
    import copy

    from fedlightning.clients.temporal_prompt import FedTIPClient, family_prototypes
    from fedlightning.temporal.adapter import PromptAdapter

    stack = stack_batches([client_batch(n, n) for n in (4, 6, 5)])
    adapter = PromptAdapter(D_H, D_T, D_E, template="paper")
    module = FedTIPClient(adapter, family)
    module.receive(adapter.state_dict(), {}, copies=3)
    module.eval()
    inputs = module.inputs_of(copy.copy(stack))
    assert module.inputs_of(copy.copy(stack)) is inputs
    with torch.no_grad():
        fast = family_views(module.adapter, stack, family, inputs)
        slow = family_views(module.adapter, stack, family)
        assert all(torch.equal(a, b) for a, b in zip(fast, slow, strict=True))
        for a, b in zip(
            family_prototypes(fast, family, inputs["classes"]),
            family_prototypes(slow, family),
            strict=True,
        ):
            assert torch.equal(a, b)
    other = stack_batches([client_batch(n, 10 + n) for n in (4, 6, 5)])
    assert module.inputs_of(other) is not inputs
