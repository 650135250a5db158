"""FedOGL wiring: each module appears in the messages and client state, and each ablation
switch removes exactly its module."""

import pytest
import torch

from fedlightning.messages import ClientUpdate
from fedlightning.methods.fedogl.fedogl_server import PrototypeMemory
from fedlightning.train import train

pytestmark = pytest.mark.slow

BASE = [
    "protocol=cil",
    "algorithm=fedogl",
    "protocol.stream.stages=[2,1,1]",
    "federation.rounds=2",
    "logger=none",
    "task=cil",
]


def modules_seen(run):
    """What was computed: message fields in the ledger, and the clients' saved state."""
    import json

    s = json.loads((run / "summary.json").read_text())
    fields = s["comm"]["fields"]
    ckpt = torch.load(run / "checkpoint.pt", weights_only=False)
    states = ckpt["clients"].values()
    return {
        "projection": any(k.startswith("basis.") for k in fields),
        "prototypes": any(k.startswith("proto.") for k in fields),
        "replay": any(m.numel() for st in states for m in st.get("replay", {}).values()),
        "distill": any("teacher" in st for st in states),
    }, s


@pytest.mark.parametrize("off", [None, "replay", "distill", "projection", "prototypes"])
def test_each_switch_turns_off_exactly_its_module(tmp_env, compose, off):
    over = BASE if off is None else [*BASE, f"algorithm.{off}=false"]
    run = tmp_env / "run"
    train(compose(over), run)
    seen, s = modules_seen(run)
    expected = {m: m != off for m in ("replay", "distill", "projection", "prototypes")}
    assert seen == expected
    assert s["tags"]["variant"] == ("full" if off is None else f"no_{off}")
    assert s["tags"]["method"] == "fedogl"
    for key in ("am", "fm", "fpr95", "val_am", "val_fm", "val_fpr95", "d_sem", "d_str", "d_fed"):
        assert key in s["metrics"]


def test_basis_upload_is_counted_per_client(tmp_env, compose):
    import json

    run = tmp_env / "run"
    train(
        compose([*BASE, "algorithm.basis.rank_local=4", "algorithm.basis.include_mean=false"]), run
    )
    s = json.loads((run / "summary.json").read_text())
    up = s["comm"]["fields"]["basis.gnn.convs.1.lin.weight"]["up"]
    nodes = s["comm"]["fields"]["basis_nodes"]["up"]
    # each basis upload is hidden (64) x rank_local (4) values, with one basis_nodes scalar
    assert nodes > 0 and up == nodes * 64 * 4


def _update(cid, w_head, protos):
    tensors = {"model.head.weight": w_head, "model.head.bias": torch.zeros(w_head.size(0))}
    scalars = {"num_examples": 10.0}
    for c, p in protos.items():
        tensors[f"proto.{c}.0"] = p
        scalars[f"proto_count.{c}.0"] = 5.0
    return ClientUpdate(1, tensors, scalars, client_id=cid)


def test_head_refinement_only_once_an_old_class_exists():
    torch.manual_seed(0)
    mem = PrototypeMemory(kappa=1, gamma=1.0, steps=3, lr=0.5)
    state = {"head.weight": torch.randn(3, 4), "head.bias": torch.zeros(3)}
    ups = [_update(0, state["head.weight"].clone(), {0: torch.randn(4), 1: torch.randn(4)})]
    mem.schedule = lambda r: ([0, 1], False)  # stage 1: no old class, gamma_t = 0
    mem.aggregate(1, ups)
    assert mem.update_global(1, state) is state
    mem.schedule = lambda r: ([0, 1, 2], True)
    mem.aggregate(2, [_update(0, state["head.weight"].clone(), {2: torch.randn(4)})])
    out = mem.update_global(2, state)
    assert not torch.equal(out["head.weight"], state["head.weight"])
    assert mem.last_refine["loss_after"] < mem.last_refine["loss_before"]
    assert len(mem.bank.prototypes()[0]) == 3  # three classes' prototypes in the bank


@pytest.mark.parametrize("off", [None, "replay", "distill", "projection", "prototypes"])
def test_retrieval_switches_turn_off_exactly_their_module(
    tmp_env, shared_data, monkeypatch, compose, off
):
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    over = [
        "experiment=cir_citeseer_mm",
        "algorithm=cir_fedogl",
        "protocol.stream.stages=[2,1,1]",
        "federation.rounds=1",
        "logger=none",
    ]
    run = tmp_env / "run"
    train(compose(over if off is None else [*over, f"algorithm.{off}=false"]), run)
    seen, s = modules_seen(run)
    assert seen == {m: m != off for m in ("replay", "distill", "projection", "prototypes")}
    assert s["tags"]["method"] == "fedogl" and s["tags"]["task"] == "cir"
    fields = s["comm"]["fields"]
    # the last GNN layer of each tower is shielded; prototypes come per modality
    expected = set()
    if off != "projection":
        expected |= {"basis.gnns.text.convs.1.lin.weight", "basis.gnns.bow.convs.1.lin.weight"}
    assert {k for k in fields if k.startswith("basis.")} == expected
    sides = {k.split(".")[1] for k in fields if k.startswith("proto.")}
    assert sides == (set() if off == "prototypes" else {"text", "bow"})
    for key in ("am", "fm", "fpr95", "val_am", "val_fpr95", "recall_at_1"):
        assert key in s["metrics"]


@pytest.mark.parametrize("task", ["cil", "cir"])
def test_fedogl_with_its_own_modules_off_is_fedavg_with_replay(
    tmp_env, shared_data, monkeypatch, compose, task
):
    """Replay alone left on, FedOGL computes exactly FedAvg + replay: same metrics, bitwise."""
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    common = ["protocol.stream.stages=[2,1,1]", "federation.rounds=1", "logger=none"]
    if task == "cir":
        common += ["experiment=cir_citeseer_mm", "algorithm=cir_fedogl"]
    off = ["algorithm.distill=false", "algorithm.projection=false", "algorithm.prototypes=false"]
    a = train(compose([*common, *off]), tmp_env / "a")
    b = train(compose([*common, f"algorithm={task}_fedavg_replay"]), tmp_env / "b")
    assert a["metrics"] == b["metrics"]
    assert a["tags"]["variant"] == "no_distill_no_projection_no_prototypes"
