r"""Temporal encoders of the FedTIP knowledge bank (paper 001, Sec. 4.2, Eq. (8); docs/temporal.md).

Both keep a streaming state and share three verbs: :meth:`embed` node states
:math:`\mathbf{h}_v^{t^-}` from the state before a batch, :meth:`ingest` a batch of events,
:meth:`reset_state`. TGN (Rossi et al., 2020): PyG's memory, last-neighbour loader and a
``TransformerConv`` whose edges carry :math:`\mathrm{TE}(t_{last}(v) - t_e)` and the event
features. TGAT (Xu et al., 2020), no memory: the query is the node's statistics with
:math:`\mathrm{TE}(0)`, keys and values each neighbour's statistics, the event's features and
:math:`\mathrm{TE}(t - t_e)`."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch_geometric.nn import TGNMemory, TransformerConv
from torch_geometric.nn.models.tgn import (
    IdentityMessage,
    LastAggregator,
    LastNeighborLoader,
    TimeEncoder,
)


class StreamState(nn.Module):
    """What every encoder keeps about the stream: the events (times, features), each node's
    most recent neighbours, and its frequency and last-event time (``S_hist`` of Eq. (11))."""

    def __init__(self, num_nodes: int, neighbors: int) -> None:
        super().__init__()
        self.num_nodes = num_nodes
        self.loader = LastNeighborLoader(num_nodes, size=neighbors)
        self.register_buffer("frequency", torch.zeros(num_nodes))
        self.register_buffer("last_time", torch.zeros(num_nodes))
        # the loader's event numbers (in ingestion order) -> stream indices
        self.ids = torch.zeros(0, dtype=torch.long)
        self.event_t = torch.zeros(0)
        self.event_msg = torch.zeros(0, 0)

    def attach(self, t: Tensor, msg: Tensor) -> None:
        """The whole stream's times ``[E]`` and features ``[E, d]``, looked up by event id."""
        self.event_t, self.event_msg = t.float(), msg.float()

    def reset_state(self) -> None:
        self.loader.reset_state()
        self.frequency.zero_()
        self.last_time.zero_()
        self.ids = torch.zeros(0, dtype=torch.long)

    def events(self, e_id: Tensor) -> tuple[Tensor, Tensor]:
        """Times and features of the loader's events ``e_id`` (any shape)."""
        # An empty slot (clamped to 0 by the caller, masked later) may precede any event.
        idx = self.ids[e_id] if len(self.ids) else torch.zeros_like(e_id)
        return self.event_t[idx], self.event_msg[idx]

    def ingest(self, src: Tensor, dst: Tensor, t: Tensor, idx: Tensor) -> None:
        self.ids = torch.cat([self.ids, idx])
        self.loader.insert(src, dst)
        nodes = torch.cat([src, dst])
        self.frequency.index_add_(0, nodes, torch.ones(len(nodes)))
        self.last_time.index_reduce_(0, nodes, torch.cat([t, t]).float(), "amax")

    def stats(self, n_id: Tensor, t: Tensor) -> Tensor:
        """``[log(1 + frequency), log(1 + t - t_last)]`` of each node at time ``t``."""
        since = (t.float() - self.last_time[n_id]).clamp(min=0)
        return torch.stack([self.frequency[n_id].log1p(), since.log1p()], dim=1)


class TGNEncoder(nn.Module):
    """TGN: memory + graph attention over the ``neighbors`` most recent neighbours."""

    def __init__(
        self,
        num_nodes: int,
        msg_dim: int,
        memory_dim: int = 64,
        time_dim: int = 64,
        embedding_dim: int = 64,
        neighbors: int = 10,
    ) -> None:
        super().__init__()
        self.memory = TGNMemory(
            num_nodes,
            msg_dim,
            memory_dim,
            time_dim,
            message_module=IdentityMessage(msg_dim, memory_dim, time_dim),
            aggregator_module=LastAggregator(),
        )
        self.state = StreamState(num_nodes, neighbors)
        self.out_dim = (embedding_dim // 2) * 2
        self.conv = TransformerConv(
            memory_dim, embedding_dim // 2, heads=2, dropout=0.1, edge_dim=msg_dim + time_dim
        )

    def reset_state(self) -> None:
        self.memory.reset_state()
        self.state.reset_state()

    def embed(self, n_id: Tensor, t: Tensor) -> Tensor:
        """States of ``n_id`` (each queried at its time ``t``) before the current batch."""
        del t  # TGN reads time through the memory's last-update times
        nodes, edge_index, e_id = self.state.loader(n_id)
        memory, last_update = self.memory(nodes)
        t_e, msg_e = self.state.events(e_id)
        rel = last_update[edge_index[1]] - t_e
        edge_attr = torch.cat([self.memory.time_enc(rel.to(memory.dtype)), msg_e], -1)
        z = self.conv(memory, edge_index, edge_attr)
        pos = torch.empty(self.state.num_nodes, dtype=torch.long)
        pos[nodes] = torch.arange(len(nodes))
        return z[pos[n_id]]

    def ingest(self, src: Tensor, dst: Tensor, t: Tensor, msg: Tensor, idx: Tensor) -> None:
        self.memory.update_state(src, dst, t, msg)
        self.state.ingest(src, dst, t, idx)

    def detach(self) -> None:
        self.memory.detach()


class TGATEncoder(nn.Module):
    """TGAT-style temporal attention over the ``neighbors`` most recent neighbours, no
    memory (``memory_dim`` is accepted for a uniform config and ignored)."""

    STATS = 2

    def __init__(
        self,
        num_nodes: int,
        msg_dim: int,
        time_dim: int = 64,
        embedding_dim: int = 64,
        neighbors: int = 10,
        heads: int = 2,
        memory_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.state = StreamState(num_nodes, neighbors)
        self.out_dim = embedding_dim
        self.time_enc = TimeEncoder(time_dim)
        self.query = nn.Linear(self.STATS + time_dim, embedding_dim)
        self.key = nn.Linear(self.STATS + msg_dim + time_dim, embedding_dim)
        self.attn = nn.MultiheadAttention(embedding_dim, heads, batch_first=True)
        self.out = nn.Sequential(
            nn.Linear(embedding_dim + self.STATS, embedding_dim),
            nn.ReLU(),
            nn.Linear(embedding_dim, embedding_dim),
        )

    def reset_state(self) -> None:
        self.state.reset_state()

    def embed(self, n_id: Tensor, t: Tensor) -> Tensor:
        s = self.state
        own = s.stats(n_id, t)
        e_id = s.loader.e_id[n_id]  # [n, k]; -1 marks an empty slot
        valid = e_id >= 0
        nbr = s.loader.neighbors[n_id].masked_fill(~valid, 0)  # empty slots hold garbage
        t_e, msg_e = s.events(e_id.clamp(min=0))
        dt = (t.float().unsqueeze(1) - t_e).clamp(min=0)
        keys = torch.cat(
            [
                s.stats(nbr.flatten(), t.repeat_interleave(nbr.size(1))).view(*nbr.shape, -1),
                msg_e,
                self.time_enc(dt.flatten()).view(*nbr.shape, -1),
            ],
            -1,
        )
        q = self.query(torch.cat([own, self.time_enc(torch.zeros(len(n_id)))], -1)).unsqueeze(1)
        k = self.key(keys)
        mask = ~valid
        empty = mask.all(1)
        mask[empty, 0] = False  # a node without neighbours attends to a zero key
        k = k.masked_fill((~valid & ~mask).unsqueeze(-1), 0.0)
        h, _ = self.attn(q, k, k, key_padding_mask=mask)
        h = h.squeeze(1).masked_fill(empty.unsqueeze(1), 0.0)
        return self.out(torch.cat([h, own], -1))

    def ingest(self, src: Tensor, dst: Tensor, t: Tensor, msg: Tensor, idx: Tensor) -> None:
        del msg  # features are read by event id
        self.state.ingest(src, dst, t, idx)

    def detach(self) -> None:
        pass


ENCODERS = {"tgn": TGNEncoder, "tgat": TGATEncoder}


def time_encoder(enc: nn.Module) -> TimeEncoder:
    """The bank's time encoding TE (Eq. (11)): TGN's memory encoder, or TGAT's own."""
    return enc.memory.time_enc if hasattr(enc, "memory") else enc.time_enc
