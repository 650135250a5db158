"""The zero-shot row (``algorithm=zero_shot``): FedTIP's protocol scored by the frozen bank's
own template, uplink 0, its AUCs equal to ones computed here from the bank states with
scikit-learn."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score

from fedlightning.programs.temporal_program import temporal_inputs
from fedlightning.recipes import composed_form
from fedlightning.resources import conf_dir
from fedlightning.train import train

SMALL = [
    "experiment=temporal_synthetic",
    "algorithm=zero_shot",
    "protocol.tasks.num_tasks=2",
    "federation.rounds=2",
    "federation.local_epochs=2",
    "bank.epochs=1",
    "bank.max_events=2000",
    "logger=none",
]


def cos(a, b):
    return F.cosine_similarity(a, b, dim=-1).numpy()


def test_zero_shot_scores_the_bank_template_with_no_uplink(env, compose):
    cfg = compose(SMALL)
    s = train(cfg, env / "z", verbose=False)
    assert s["tags"]["method"] == "zero_shot" and s["tags"]["variant"] == "full"
    assert s["comm"]["uplink_values"] == 0 and s["comm"]["uplink_mib"] == 0
    assert s["comm"]["adapter_values"] == 0
    assert set(s["comm"]["message_values_by_hand"].values()) == {0}
    m = s["metrics"]
    for k in ("auc_nc", "auc_tlp", "auc_ilp", "val_auc_nc", "val_auc_tlp"):
        assert k in m and 0.0 <= m[k] <= 1.0, k
    rows = json.loads((env / "z" / "task_metrics.json").read_text())

    # independently: the same server segments and supports, scored here
    inputs = temporal_inputs(cfg)
    for split, prefix in (("test", ""), ("val", "val_")):
        b = {k: v[0] for k, v in inputs["evals"][split].items()}
        ok = b["neg_ok"]
        pos, neg = cos(b["h_u"][ok], b["h_i"][ok]), cos(b["h_u"][ok], b["h_j"][ok])
        want = roc_auc_score(np.r_[np.ones(len(pos)), np.zeros(len(neg))], np.r_[pos, neg])
        # the bank template is the same on every task: the same AUC on each
        assert [r[prefix + "auc_tlp"] for r in rows] == pytest.approx([want] * 2, abs=1e-6)
        # node classification: class means of the bank states of task 0's pooled support
        sup = inputs["tasks"][0].clients.values()
        h = torch.cat([c["h_u"] for c in sup])
        y = torch.cat([c["y"] for c in sup])
        q0, q1 = h[y == 0].mean(0), h[y == 1].mean(0)
        lab = b["y"] >= 0
        score = cos(b["h_u"][lab], q1[None]) - cos(b["h_u"][lab], q0[None])
        want_nc = roc_auc_score(b["y"][lab].numpy(), score)
        assert rows[0][prefix + "auc_nc"] == pytest.approx(want_nc, abs=1e-6)


def test_zero_shot_composes_from_its_run_name(compose):
    for stream in ("bitcoin_alpha", "wikipedia", "synthetic"):
        over = composed_form(f"zero_shot_{stream}", conf_dir())
        assert over == [f"experiment=temporal_{stream}", "algorithm=zero_shot"]
        assert compose(over).name == f"zero_shot_{stream}"
