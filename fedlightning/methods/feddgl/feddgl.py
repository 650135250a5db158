"""FedDGL (Xie et al., ACML 2024), a published baseline of FedTIP's Table 2 (docs/fedtip.md,
"FedDGL"): a GCN whose weights evolve over the history's snapshots
(:class:`~fedlightning.methods.dynamic.dynamic_model.FedDGLNet`), trained with the protocol's
family loss plus ``lambda_proto`` times the distance of the client's prototypes to the
server's generated global ones; the client uploads its model and prototypes; the server
(:class:`~fedlightning.methods.feddgl.feddgl_server.FedDGLServer`) averages the models, fits its prototype
generator and weighs each client by the cosine of its prototypes with the global ones; each
client starts the next round from its personalised mixture of the FedAvg model and its own.
The server's segments are scored with the FedAvg model and the generated prototypes.
"""

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
from fedlightning.server.aggregate import strip_prefix
from fedlightning.server.reliability import unflatten

CLASSES = (0, 1)


@dataclass
class FedDGL(DynamicBaseline):
    """FedDGL (module docstring). ``lambda_proto``: the prototype term's weight;
    ``mix_temperature``, ``margin_cap``, ``gen_lr``, ``gen_steps``: the server's."""

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
        """``m_*``, ``d_*``: the last window's neighbour means and degrees."""
        last = self.snapshot_means(nodes, 0)
        deg = {f"d_{s}": self.view.degree[-1][v] for s, v in nodes.items()}
        return {**{f"m_{s}": v for s, v in last.items()}, **deg}

    def message_fields(self, family: str) -> tuple[str, ...]:
        """The model's delta, the class counts and the prototypes (both families)."""
        return ("delta", "counts", "prototypes")

    def task_server(self, module: DynamicBaselineClient) -> FedDGLServer:
        """A fresh server; the clients' own models are forgotten (a new task)."""
        self.personal = {}
        start = {n: p.detach().clone() for n, p in module.net.named_parameters()}
        return FedDGLServer(
            start, module.net.d_h, CLASSES, self.margin_cap, self.gen_lr, self.gen_steps,
            self.mix_temperature,
        )  # fmt: skip

    def starts(
        self, broadcast: ServerBroadcast, module: DynamicBaselineClient, clients: list[int]
    ) -> list[dict[str, Tensor]]:
        """Client ``k`` starts from :func:`~fedlightning.methods.feddgl.feddgl_server.personalise` of the
        FedAvg model and its own last model with its broadcast weight (the FedAvg model in
        its first round of the task); the broadcast global prototypes go to the loss."""
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
        """Each client keeps its trained model for the next round's mixture."""
        for i, k in enumerate(clients):
            self.personal[k] = torch.cat([p.reshape(-1) for p in module.net.copy_state(i).values()])
