"""The exact input that multiplies a GNN layer's weight: the space of its basis (Eq. 7)."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch_geometric.nn import GCNConv, SAGEConv
from torch_geometric.nn.conv.gcn_conv import gcn_norm

from fedlightning.models.multimodal import GNNEncoder


def protected_input(
    conv: GCNConv | SAGEConv,
    x: Tensor,
    edge_index: Tensor,
    edge_weight: Tensor | None = None,
) -> Tensor | dict[str, Tensor]:
    """The tensor that multiplies the layer's weight on input ``x`` [n, in]: ``A_hat x`` for
    GCNConv; ``{"lin_l": aggr, "lin_r": x}`` for SAGEConv (no ``lin_r`` without root weight)."""
    if isinstance(conv, GCNConv):
        ei, ew = edge_index, edge_weight
        if conv.normalize:
            ei, ew = gcn_norm(
                edge_index,
                edge_weight,
                x.size(conv.node_dim),
                conv.improved,
                conv.add_self_loops,
                conv.flow,
                x.dtype,
            )
        return conv.propagate(ei, x=x, edge_weight=ew)
    if isinstance(conv, SAGEConv):
        if edge_weight is not None:
            raise ValueError("SAGEConv takes no edge weights")
        pair = (x, x)
        if conv.project and hasattr(conv, "lin"):
            pair = (conv.lin(x).relu(), x)
        out = {"lin_l": conv.propagate(edge_index, x=pair, size=None)}
        if conv.root_weight:
            out["lin_r"] = pair[1]
        return out
    raise TypeError(f"protected_input supports GCNConv and SAGEConv, got {type(conv).__name__}")


def protected_inputs(net: nn.Module, data: Any, layer: int = -1) -> dict[str, Tensor]:
    """Parameter name -> :func:`protected_input` on ``data``, for layer ``layer`` of each GNN
    ``net.gnn_inputs`` names."""
    out = {}
    for name, x in net.gnn_inputs(data).items():
        gnn = net.get_submodule(name)
        at = layer % len(gnn.convs)
        h = gnn.forward_until(x, data.edge_index, at)
        inp = protected_input(gnn.convs[at], h, data.edge_index)
        inp = inp if isinstance(inp, dict) else {"lin": inp}
        out.update({f"{name}.convs.{at}.{k}.weight": v for k, v in inp.items()})
    return out


def protected_biases(net: nn.Module, layer: int = -1) -> list[str]:
    """The biases of the protected layer of every GNN of ``net`` (frozen after stage 1)."""
    own = dict(net.named_parameters())
    names = []
    for name, gnn in net.named_modules():
        if isinstance(gnn, GNNEncoder):
            at = layer % len(gnn.convs)
            names += [f"{name}.convs.{at}.bias", f"{name}.convs.{at}.lin_l.bias"]
    return [n for n in names if n in own]
