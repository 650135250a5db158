"""FedDGL (Xie et al., ACML 2024; docs/fedtip.md, "FedDGL"): an evolving GCN with a prototype
term; each client starts a round from its personalised mixture of FedAvg's model and its own."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fedlightning.federation.task_loop import TaskContext
from fedlightning.messages import ServerBroadcast
from fedlightning.methods.dynamic.dynamic_baselines import DynamicBaseline
from fedlightning.methods.dynamic.dynamic_client import DynamicBaselineClient
from fedlightning.methods.dynamic.dynamic_model import FedDGLNet
from fedlightning.methods.feddgl.feddgl_server import GLOB, MIX, FedDGLServer, personalise
from fedlightning.methods.temporal_base.temporal_base import CLASSES
from fedlightning.server.aggregate import strip_prefix
from fedlightning.server.reliability import unflatten


@dataclass
class FedDGL(DynamicBaseline):
    """FedDGL; ``lambda_proto``: the prototype term's weight; the rest the server's."""

    name: str = "feddgl"
    lambda_proto: float = 0.1
    mix_temperature: float = 0.5
    margin_cap: float = 100.0
    gen_lr: float = 0.05
    gen_steps: int = 20
    hidden: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        self.personal: dict[int, dict[str, Tensor]] = {}
        self._glob: dict[str, Tensor] = {}

    def net(self, d_h: int) -> FedDGLNet:
        return FedDGLNet(d_h, self.hidden, self.windows)

    def client_terms(self) -> dict[str, float]:
        return {"lambda_proto": self.lambda_proto}

    def event_inputs(self, nodes: dict[str, Tensor]) -> dict[str, Tensor]:
        last = self.snapshot_means(nodes, 0)
        deg = {f"d_{s}": self.view.degree[-1][v] for s, v in nodes.items()}
        return {**{f"m_{s}": v for s, v in last.items()}, **deg}

    def message_fields(self, family: str) -> tuple[str, ...]:
        return ("delta", "counts", "prototypes")

    def task_server(self, module: DynamicBaselineClient) -> FedDGLServer:
        self.personal = {}
        start = {n: p.detach().clone() for n, p in module.net.named_parameters()}
        return FedDGLServer(
            start, module.net.d_h, CLASSES, self.margin_cap, self.gen_lr, self.gen_steps,
            self.mix_temperature,
        )  # fmt: skip

    def starts(
        self, broadcast: ServerBroadcast, module: DynamicBaselineClient, clients: list[int]
    ) -> list[dict[str, Tensor]]:
        """Each client's :func:`personalise` start; the global prototypes go to the loss."""
        shapes = {n: (1, *p.shape[1:]) for n, p in module.net.named_parameters()}
        omega = broadcast.tensors["model"]
        mix = {int(k): float(w) for k, w in strip_prefix(broadcast.scalars, MIX).items()}
        out = []
        for k in clients:
            own = self.personal.get(k)
            flat = omega if own is None or k not in mix else personalise(omega, own, mix[k])
            out.append(unflatten(flat, shapes))
        glob = {int(c): q for c, q in strip_prefix(broadcast.tensors, GLOB).items()}
        has = torch.tensor([c in glob for c in CLASSES])
        d = module.net.d_h
        self._glob = {
            "glob": torch.stack([glob.get(c, torch.zeros(d)) for c in CLASSES]),
            "has_glob": has,
        }
        return out

    def client_extras(self, context: TaskContext, clients: list[int]) -> dict[str, Tensor]:
        return dict(self._glob) if bool(self._glob.get("has_glob", torch.zeros(1)).any()) else {}

    def after_fit(self, module: DynamicBaselineClient, clients: list[int]) -> None:
        for i, k in enumerate(clients):
            self.personal[k] = torch.cat([p.reshape(-1) for p in module.net.copy_state(i).values()])
