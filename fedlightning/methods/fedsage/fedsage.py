"""FedSage+ (Zhang et al., NeurIPS 2021) on FedTIP's protocol (docs/fedtip.md, "FedSage+"):
``gen_rounds`` FedAvg rounds of NeighGen before the first task, the graphs mended by the
global generator, then per task a GraphSAGE fitted by FedAvg."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fedlightning.federation.ledger import CommLedger
from fedlightning.federation.round import ClientWork, federated_round
from fedlightning.federation.task_loop import Member, TaskLoop
from fedlightning.messages import ClientUpdate, ServerBroadcast
from fedlightning.methods.fedsage.fedsage_client import NeighGenClient
from fedlightning.methods.fedsage.fedsage_model import (
    NeighGen,
    SageNet,
    impair,
    local_batch,
    mend,
    relabel,
)
from fedlightning.methods.fulltune.fulltune import fedavg_server
from fedlightning.methods.history.graph_task import ClientGraph
from fedlightning.methods.history.history_baseline import HistoryBaseline, client_nodes
from fedlightning.server.reliability import unflatten
from fedlightning.server.validation import Field, MessageSpec
from fedlightning.utils.seeding import derive_seed, manual_seed, torch_generator

GENERATOR = "generator"  # the ledger prefix of the generator round


@dataclass
class FedSagePlus(HistoryBaseline):
    """``fedsage_plus``; ``latent``, ``num_pred``: NeighGen's; ``hide``, ``gen_*``: the
    generator round's."""

    name: str = "fedsage_plus"
    hidden: int = 128
    out: int = 64
    latent: int = 128
    num_pred: int = 5
    hide: float = 0.5
    gen_rounds: int = 10
    gen_lr: float = 1e-3
    lambda_feat: float = 1.0
    lr: float = 1e-2
    dropout: float = 0.0
    mending: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.hide < 1:
            raise ValueError(f"algorithm.hide must lie in (0, 1), got {self.hide}")
        self.graphs: dict[int, ClientGraph] = {}
        self.generator: NeighGen | None = None

    def model(self, d_in: int) -> nn.Module:
        return SageNet(d_in, self.hidden, self.out, self.dropout)

    def impaired(self, k: int, seed: int) -> dict[str, Tensor]:
        """Client ``k``'s generator batch (:func:`local_batch` of its impaired graph)."""
        g, edges = self.history, self.local[k]
        gen = torch_generator(seed, "fedsage", "hide", k)
        kept, _, imp, missing = impair(edges, client_nodes(edges), g.num_nodes, self.hide, gen)
        return local_batch(g.x, kept, imp, missing)

    def before_tasks(self, loop: TaskLoop, ledger: CommLedger, scope: str) -> None:
        """The generator round (ledger prefix ``generator``), then the mended graphs."""
        d = self.history.x.size(1)
        manual_seed(derive_seed(loop.seed, "fedsage", "init"))
        gen = NeighGen(d, self.latent, self.num_pred)
        module = NeighGenClient(gen, self.gen_lr, self.lambda_feat)
        server = fedavg_server(gen)
        shapes = {n: p.shape for n, p in gen.named_parameters()}
        batches = {k: self.impaired(k, loop.seed) for k in self.clients}
        spec = MessageSpec(
            (
                Field("delta", dtype="like", like=lambda m: "model"),
                Field(r"count\.0", tensor=False, low=1.0, integral=True),
            )
        )

        def work(broadcast: ServerBroadcast) -> ClientWork:
            omega, r = unflatten(broadcast.tensors["model"], shapes), broadcast.round

            def fit(member: Member) -> ClientUpdate:
                k = member.client_id
                module.receive(omega)
                manual_seed(derive_seed(loop.seed, "fedsage", "gen", r, k))
                loop.runner.executor.fit(module, batches[k], loop.epochs)
                delta = torch.cat(
                    [(p.detach() - omega[n]).reshape(-1) for n, p in gen.named_parameters()]
                )
                n = max(len(batches[k]["kept"]), 1)
                return ClientUpdate(r, {"delta": delta}, {"count.0": float(n)}, client_id=k)

            return ClientWork(one=fit, uplink=spec)

        members = [Member(k) for k in self.clients]
        for r in range(1, self.gen_rounds + 1):
            federated_round(r, server, loop.runner, members, work, ledger,
                            prefix=GENERATOR, scope=scope)  # fmt: skip
        gen.load_state_dict(server.state())
        gen.eval()
        self.generator = gen
        self.graphs = {k: self.mended(self.local[k]) for k in self.clients}
        self.graphs[-1] = self.mended(self.everything)

    @torch.no_grad()
    def mended(self, edges: Tensor) -> ClientGraph:
        """``edges`` mended by the global generator (unchanged with ``mending=false``)."""
        x = self.history.x
        if not self.mending:
            return ClientGraph(x, edges)
        nodes = client_nodes(edges)  # a node's generation reads its 1-hop neighbours only
        degree, features = self.generator(x[nodes], relabel(edges, nodes, x.size(0)))
        deg = x.new_zeros(x.size(0)).index_copy(0, nodes, degree)
        feats = x.new_zeros(x.size(0), *features.shape[1:]).index_copy(0, nodes, features)
        x2, e2, _ = mend(x, edges, nodes, deg, feats)
        return ClientGraph(x2, e2)

    def client_graph(self, k: int) -> ClientGraph:
        return self.graphs[k]

    def server_graph(self) -> ClientGraph:
        return self.graphs[-1]
