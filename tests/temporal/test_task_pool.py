"""FedTIP's tasks on several processes (``task_workers``) and the packed checkpoint: the
same metrics, ledger and resume as one process writing plain entries."""

import math

import pytest
import torch

from fedlightning.clients.temporal_prompt import as_single
from fedlightning.errors import ConfigError
from fedlightning.federation.executors import LeanExecutor
from fedlightning.federation.runners import SequentialRunner
from fedlightning.federation.task_loop import TaskBatches, TaskLoop
from fedlightning.federation.task_pool import resolve_workers
from fedlightning.methods.fedtip.fedtip import FedTIP

D_H, D_T, D_E = 4, 3, 2


def batch(n, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {
        **{k: r(n, D_H) for k in ("h_u", "h_i", "h_j")},
        "te": r(n, D_T),
        "x": r(n, D_E),
        **{k: r(n).abs() for k in ("r_u", "r_i", "r_j")},
        "y": torch.arange(n) % 2,
        "neg_ok": torch.ones(n, dtype=torch.bool),
        "inductive": torch.arange(n) % 3 == 0,
    }


def loop(workers=1, **kw):
    clients = [[1, 2, 3], [2, 4], [1, 5, 6], [3, 6], [7, 2]]  # clients recur: the bank once
    tasks = [
        TaskBatches(t, {k: batch(4 + (t + k) % 3, 10 * t + k) for k in ks})
        for t, ks in enumerate(clients)
    ]
    evals = {"val": as_single(batch(30, 98)), "test": as_single(batch(40, 99))}
    return TaskLoop(
        FedTIP(), tasks, evals, ["nc", "lp"], (D_H, D_T, D_E),
        SequentialRunner(LeanExecutor(), progress=False),
        rounds=2, epochs=2, seed=5, bank_values=100, progress=False, workers=workers, **kw,
    )  # fmt: skip


def same(a, b):
    """Per-task metrics equal bitwise (NaN to NaN), the wall time aside."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            if k != "task_time_s":
                assert x[k] == y[k] or (math.isnan(x[k]) and math.isnan(y[k])), k


def test_task_workers_give_the_one_process_run(tmp_path):
    one, two = (
        loop(1, checkpoint_path=tmp_path / "a.pt"),
        loop(2, checkpoint_path=tmp_path / "b.pt"),
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what each worker runs on
    try:
        first = one.run()
    finally:
        torch.set_num_threads(threads)
    same(first, two.run())
    assert two.ledger.entries == one.ledger.entries  # the same records, in the same order
    assert two.provisioned == one.provisioned == {1, 2, 3, 4, 5, 6, 7}
    assert two.comm() == one.comm() and two.final_metrics().keys() == one.final_metrics().keys()
    # the bank goes down once per client, in the task that first has it (as one process)
    banks = [(e[2], e[6]) for e in two.ledger.entries if e[3] == "bank"]
    assert banks == [(1, "task=0"), (2, "task=0"), (3, "task=0"), (4, "task=1"), (5, "task=2"),
                     (6, "task=2"), (7, "task=4")]  # fmt: skip
    # the checkpoints written along the way restore the same ledger
    for path in (tmp_path / "a.pt", tmp_path / "b.pt"):
        again = loop()
        again.load_state_dict(torch.load(path, weights_only=False))
        assert again.ledger.entries == one.ledger.entries
        same(again.results, one.results)


def test_a_packed_checkpoint_resumes_at_the_next_task(tmp_path):
    straight = loop().run()
    first = loop(checkpoint_path=tmp_path / "ck.pt")
    first.tasks = first.tasks[:2]  # stopped after two tasks, as a killed run would be
    first.run()
    state = torch.load(tmp_path / "ck.pt", weights_only=False)
    assert "entries" not in state["ledger"] and len(state["ledger"]["packed"]) == 2  # per task
    resumed = loop(2)
    resumed.load_state_dict(state)
    same(resumed.run(), straight)
    # a checkpoint with plain entries (written before packing) still resumes
    plain = loop()
    plain.tasks = plain.tasks[:2]
    plain.run()
    old = {**plain.state_dict(), "ledger": {"entries": plain.ledger.entries, "rejections": []}}
    back = loop()
    back.load_state_dict(old)
    same(back.run(), straight)


def test_task_workers_setting():
    runner = SequentialRunner(LeanExecutor(), progress=False)
    assert resolve_workers(None, 10, runner) == 1
    assert resolve_workers(3, 10, runner) == 3
    assert 1 <= resolve_workers("auto", 2, runner) <= 2
    for bad in (0, -1, "two", 1.5, True):
        with pytest.raises(ConfigError, match="task_workers"):
            resolve_workers(bad, 10, runner)
    gpu = SequentialRunner(LeanExecutor(device="cuda"), progress=False)
    with pytest.raises(ConfigError, match="runner=sequential on the CPU"):
        resolve_workers(2, 10, gpu)
    assert resolve_workers("auto", 10, gpu) == 1
    killed = SequentialRunner(LeanExecutor(), progress=False, kill_at="1:1:task_fit")
    assert resolve_workers("auto", 10, killed) == 1  # the pool would lose its killed worker
    assert resolve_workers(2, 10, killed) == 2
    assert resolve_workers("auto", 10, runner, poolable=False) == 1  # a one-off exchange
    with pytest.raises(ConfigError, match="one-off exchange"):
        resolve_workers(2, 10, runner, poolable=False)


def test_the_default_task_workers_give_the_one_process_run():
    from omegaconf import OmegaConf

    from fedlightning.resources import conf_dir

    assert OmegaConf.load(conf_dir() / "train.yaml").task_workers == "auto"  # the default
    runner = SequentialRunner(LeanExecutor(), progress=False)
    workers = resolve_workers("auto", 5, runner)  # the usable cores, at most the 5 tasks
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what each worker runs on, and the one-process reference
    try:
        first = loop(1)
        one = first.run()
    finally:
        torch.set_num_threads(threads)
    auto = loop(workers)
    same(auto.run(), one)
    assert auto.ledger.entries == first.ledger.entries
