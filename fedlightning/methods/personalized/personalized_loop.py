"""The class-incremental loop for personalized methods (FedSSP, FedIIH): each client is
evaluated with its own model, the one it would start its next round from."""

from __future__ import annotations

from typing import Any

import torch

from fedlightning.federation.stages import ContinualLoop


class PersonalizedLoop(ContinualLoop):
    """:class:`~fedlightning.federation.stages.ContinualLoop` whose evaluation (the closed-set
    accuracy after every round, the open-world evaluation after every stage) runs client
    ``c``'s own weights, ``algorithm.eval_state(c, broadcast)``: what ``c`` would load from the
    server's current broadcast (its local layers and the shared ones; FedIIH's personalized
    blocks), so a method whose clients keep local parameters is measured on the models its
    clients use. Clients are evaluated one at a time (never stacked)."""

    @torch.no_grad()
    def _forward_all(self) -> list[tuple[Any, ...]]:
        broadcast = self.server.broadcast(self.completed_rounds + 1)
        net = self.module.net
        out = []
        for c in self.clients:
            net.load_state_dict(self.algorithm.eval_state(c, broadcast))
            net.eval()
            out.append((c, *self._outputs(net, c.data)))
        net.train()
        return out
