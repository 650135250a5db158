"""What FedMVP and PRISM share: FedAvg + replay + MSP with a class bank in two buffers of the
net that the server writes; clients send one prototype and its count per class instead."""

from __future__ import annotations

import re
from typing import Any

import torch

from fedlightning.errors import ConfigError
from fedlightning.federation.algorithm import FederatedClient
from fedlightning.messages import ClientUpdate, ServerBroadcast
from fedlightning.methods.class_bank.class_bank_server import ClassBank
from fedlightning.methods.continual.continual import ContinualFedAvg
from fedlightning.server import Server
from fedlightning.server.aggregate import MODEL_PREFIX
from fedlightning.server.validation import (
    NUM_EXAMPLES,
    TRAIN_LOSS,
    Field,
    MessageSpec,
    Rule,
    complete,
    model_fields,
)


class ClassBankFedAvg(ContinualFedAvg):
    """Subclasses set the buffers, prefixes, ``net_class`` and :meth:`class_rows`."""

    bank_buffer, seen_buffer = "", ""
    bank_prefix, count_prefix = "", ""
    net_class: type = object
    model_name = ""

    def client_module(self, net: Any, optimizer: Any) -> Any:
        if not isinstance(net, self.net_class):
            raise ConfigError(
                "model",
                f"{self.name} needs model={self.model_name} "
                f"({self.net_class.__name__}), got {type(net).__name__}",
            )
        return self.make_module(net, optimizer)

    def make_module(self, net: Any, optimizer: Any) -> Any:
        return super().client_module(net, optimizer)

    def bank_fields(self) -> tuple[str, str]:
        return MODEL_PREFIX + self.bank_buffer, MODEL_PREFIX + self.seen_buffer

    def server(self, global_state: dict) -> Server:
        bank = ClassBank(
            global_state[self.bank_buffer],
            self.bank_buffer,
            self.seen_buffer,
            self.bank_prefix,
            self.count_prefix,
        )
        return Server(global_state, modules={"bank": bank}, **self.bounds())

    # ---------------------------------------------------------------- declared messages
    def uplink(self, broadcast: ServerBroadcast) -> MessageSpec:
        """The model less the bank's buffers, and per known class a bank row with its whole
        count within ``num_examples``."""
        skip = self.bank_fields()
        reference = ServerBroadcast(
            broadcast.round, {k: v for k, v in broadcast.tensors.items() if k not in skip}
        )
        known = frozenset(self.stream.known(self.stage_of(broadcast.round)))
        row = tuple(broadcast.tensors[skip[0]].shape[1:]) if skip[0] in broadcast.tensors else None
        name = r"(?P<c>\d+)"
        fields = (
            model_fields(),
            NUM_EXAMPLES,
            *((TRAIN_LOSS,) if self.report_train_loss else ()),
            Field(re.escape(self.bank_prefix) + name, shape=row, classes=known, required=False),
            Field(
                re.escape(self.count_prefix) + name,
                tensor=False,
                low=1.0,
                integral=True,
                classes=known,
                required=False,
            ),  # fmt: skip
        )
        rules = (
            complete(reference),
            Rule(self.check_bank_fields, reads=(re.escape(self.count_prefix) + ".+",)),
        )
        return MessageSpec(fields, rules=rules, reference=broadcast)

    def check_bank_fields(self, update: ClientUpdate) -> str | None:
        """Each prototype with its count, no bank buffer, each count <= ``num_examples``."""
        for key in self.bank_fields():
            if key in update.tensors:
                return f"{key}: the server writes the bank; a client does not send it"
        protos = {
            k[len(self.bank_prefix) :] for k in update.tensors if k.startswith(self.bank_prefix)
        }
        counts = {
            k[len(self.count_prefix) :] for k in update.scalars if k.startswith(self.count_prefix)
        }
        for c in sorted(protos ^ counts):
            return f"{self.bank_prefix}{c}: a prototype and its count travel together"
        for c in sorted(counts):
            if update.scalars[self.count_prefix + c] > update.scalars.get("num_examples", 0.0):
                return f"{self.count_prefix}{c}: more than num_examples"
        return None

    # ---------------------------------------------------------------- client side
    def make_update(self, module: Any, client: FederatedClient, round: int) -> ClientUpdate:
        update = super().make_update(module, client, round)
        for key in self.bank_fields():
            update.tensors.pop(key, None)
        return update

    def finish(
        self, module: Any, client: FederatedClient, broadcast: ServerBroadcast, batch: Any
    ) -> ClientUpdate:
        update = super().finish(module, client, broadcast, batch)
        module.net.eval()
        with torch.no_grad():
            rows = self.class_rows(module.net, batch)
        module.net.train()
        for c, (p, n) in sorted(rows.items()):
            update.tensors[f"{self.bank_prefix}{c}"] = p.detach().clone()
            update.scalars[f"{self.count_prefix}{c}"] = float(n)
        return update

    def class_rows(self, net: Any, batch: Any) -> dict[int, tuple[torch.Tensor, int]]:
        raise NotImplementedError
