"""The Flower ``ServerApp`` (run config: ``overrides``, ``run-dir``, ``resume``) and
``ClientApp`` (node config: ``partition-id``, ``num-partitions``, ``state-dir``, ``data-root``,
default ``$FEDLIGHTNING_DATA``) of fedlightning, and :func:`simulate`, both in Flower's
simulation engine (docs/scaling.md)."""

from __future__ import annotations

import json
import os
import shlex
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from omegaconf import DictConfig

from fedlightning.config import build, run_label
from fedlightning.errors import ConfigError
from fedlightning.flower.node import node_folder, open_node, setup_node
from fedlightning.flower.records import TASK
from fedlightning.flower.runner import run_clients

DEFAULT_STATE_DIR = "~/.cache/fedlightning/flower"


# ---------------------------------------------------------------------------- server
def flower_configs(overrides: list[str]) -> tuple[DictConfig, DictConfig]:
    """This invocation's config (with ``runner=flower``) and the config the run trains: the
    same, or on ``resume=DIR`` the saved one; any federated schedule, but not ``task=bank``
    (the bank is pre-trained centrally)."""
    from fedlightning.config import compose
    from fedlightning.runs import CONFIG_FILE, trained_config

    cfg = compose([*overrides, "runner=flower"])
    if cfg.get("resume") and not (Path(cfg.resume) / CONFIG_FILE).is_file():
        raise ConfigError("resume", f"{cfg.resume} holds no {CONFIG_FILE}; pass a run directory")
    trained = trained_config(cfg)
    if trained.get("task") == "bank":
        raise ConfigError(
            "runner",
            f"runner=flower runs federated rounds; task=bank (experiment {trained.get('name')}) "
            "pre-trains the bank centrally: use runner=sequential",
        )
    if trained.get("task") == "temporal" and not flower_nodes(trained.algorithm):
        raise ConfigError(
            "runner",
            f"runner=flower cannot run {trained.algorithm.get('name')} (its nodes hold neither "
            "its history view nor its one-off exchange): use runner=sequential or "
            "runner=distributed",
        )
    return cfg, trained


def flower_nodes(algorithm: DictConfig) -> bool:
    """Whether the temporal ``algorithm`` runs on Flower's nodes (a class attribute
    ``flower_nodes``, default yes; the class is imported, not built)."""
    from hydra.utils import get_class

    target = algorithm.get("_target_")
    return target is None or bool(getattr(get_class(str(target)), "flower_nodes", True))


def default_run_dir(cfg: DictConfig) -> Path:
    """``outputs/<data>/<name>/<time>``, as ``fedlightning train`` names its runs."""
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S-%f")
    return Path("outputs") / run_label(cfg) / str(cfg.name) / stamp


def make_server_app(
    overrides: list[str] | None = None,
    run_dir: Path | None = None,
    result: dict[str, Any] | None = None,
) -> ServerApp:
    """A ``ServerApp`` that trains ``overrides`` (``None``: from the run config) with its
    clients on the grid's nodes and puts the summary (or the exception) into ``result``."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        from fedlightning.train import train

        args, folder = overrides, run_dir
        if overrides is None:  # the `flwr run --run-config` keys
            config = dict(context.run_config)
            args = shlex.split(str(config.get("overrides", "")))
            if config.get("resume"):
                args.append(f"resume={config['resume']}")
            folder = Path(str(config["run-dir"])) if config.get("run-dir") else None
        try:
            cfg, _ = flower_configs(args)
            runner = build(cfg.runner, "runner", grid=grid)
            summary = train(cfg, folder or default_run_dir(cfg), runner=runner)
        except BaseException as e:
            if result is None:
                raise
            result["error"] = e
            return
        if result is not None:
            result["summary"] = summary

    return app


# ---------------------------------------------------------------------------- client
def make_client_app(state_dir: Path | None = None) -> ClientApp:
    """A ``ClientApp`` whose client folders live under the node config's ``state-dir``,
    else ``state_dir``, else ``~/.cache/fedlightning/flower``."""
    app = ClientApp()

    def open_task(msg: Message, context: Context) -> tuple[Any, Path, int]:
        """The message's task, this node's client folder and id."""
        if "partition-id" not in context.node_config:
            raise ConfigError(
                "partition-id",
                "this SuperNode has no client: start it with --node-config 'partition-id=K'",
            )
        task, k = msg.content[TASK], int(context.node_config["partition-id"])
        root = context.node_config.get("state-dir") or state_dir or DEFAULT_STATE_DIR
        return task, node_folder(str(root), str(task["run"]), k), k

    @app.query()
    def setup(msg: Message, context: Context) -> Message:
        task, where, k = open_task(msg, context)
        parts = context.node_config.get("num-partitions")
        if parts is not None and int(parts) != int(task["clients"]):
            raise ConfigError(
                "federation.clients (protocol.ownership.clients for FedTIP)",
                f"the run has {task['clients']} clients, this node's num-partitions is {parts}",
            )
        torch.set_num_threads(int(task["threads"]))
        data_root = context.node_config.get("data-root") or os.environ.get("FEDLIGHTNING_DATA")
        hashes = json.loads(str(task["hashes"]))
        setup_node(where, k, str(task["config"]), hashes, data_root)
        return Message(RecordDict({TASK: ConfigRecord({"client": k})}), reply_to=msg)

    def answer(msg: Message, context: Context) -> Message:
        task, where, k = open_task(msg, context)
        node = open_node(where, k)
        torch.set_num_threads(int(task["threads"]))
        reply = node.answer(msg.metadata.message_type, msg.content, dict(task))
        return Message(reply, reply_to=msg)

    app.train()(answer)
    app.evaluate()(answer)
    return app


server_app = make_server_app()
client_app = make_client_app()


# ---------------------------------------------------------------------------- simulation
def simulate(overrides: list[str], run_dir: Path | None = None) -> dict[str, Any]:
    """Run ``overrides`` in Flower's simulation engine, one virtual node per client; each
    node's folder lives in the run directory's ``nodes/``. Returns the run's summary."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # Ray: no usage reports
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # and no warning about it
    from flwr.simulation import run_simulation

    cfg, trained = flower_configs(overrides)
    if cfg.get("resume"):
        run_dir = Path(cfg.resume)
    run_dir = Path(run_dir or default_run_dir(cfg)).resolve()
    result: dict[str, Any] = {}
    run_simulation(
        make_server_app(overrides, run_dir, result),
        make_client_app(run_dir / "nodes"),
        num_supernodes=run_clients(trained),
        backend_config={
            "client_resources": {"num_cpus": float(cfg.runner.client_cpus), "num_gpus": 0.0},
            "init_args": {"include_dashboard": False, "log_to_driver": False},
        },
    )
    if "error" in result:
        raise result["error"]
    if "summary" not in result:
        raise RuntimeError("the Flower simulation ended without running the ServerApp")
    return result["summary"]
