"""Where the structural basis lives: the exact input that multiplies a GNN layer's weight.

Client-side companion of :mod:`fedlightning.server.basis` (FedOGL Eqs. (7)-(9)): the basis of
a protected weight is built from the tensor this module returns for the stage's nodes.
"""

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
    r"""The exact tensor that multiplies a PyG layer's weight, the space of its basis.

    For :class:`~torch_geometric.nn.conv.GCNConv`, which applies ``lin`` before
    propagating, :math:`\hat{\mathbf{A}}(\mathbf{X}\mathbf{W}^\top) =
    (\hat{\mathbf{A}}\mathbf{X})\mathbf{W}^\top`, so the input of ``lin.weight`` is the
    normalised aggregated input

    .. math::
        \hat{\mathbf{A}}\mathbf{X},\quad
        \hat{\mathbf{A}} = \mathbf{D}^{-1/2}(\mathbf{A}+\mathbf{I})\mathbf{D}^{-1/2}

    (with the layer's own ``add_self_loops``, ``improved`` and ``normalize`` settings), and
    ``conv(x) == A_hat_x @ lin.weight.T + bias``.

    For :class:`~torch_geometric.nn.conv.SAGEConv`, ``lin_l`` multiplies the aggregated
    neighbours (mean by default; after the layer's ``project`` transform when it has one)
    and ``lin_r`` the root features:

    .. math::
        \mathbf{x}'_i = \mathbf{W}_l\, \mathrm{aggr}_{j\in\mathcal{N}(i)} \mathbf{x}_j
        + \mathbf{b}_l + \mathbf{W}_r \mathbf{x}_i

    so the function returns ``{"lin_l": aggr, "lin_r": x}`` (without ``"lin_r"`` when
    ``root_weight=False``); with ``normalize=True`` the identity holds before the layer's
    final L2 normalisation.

    Args:
        conv: a ``GCNConv`` or ``SAGEConv`` layer.
        x (Tensor): the layer's input ``[n, in]`` (what the model feeds it, e.g. after the
            previous layer's activation; dropout off).
        edge_index (Tensor): ``[2, E]``.
        edge_weight (Tensor, optional): ``[E]``, ``GCNConv`` only. (default: ``None``)

    Returns:
        ``[n, in]`` for ``GCNConv``; ``dict[str, Tensor]`` of ``[n, in]`` for ``SAGEConv``.
    """
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
    """Protected weights of every GNN of a backbone and their inputs on ``data``.

    Returns parameter name (relative to ``net``) -> the tensor that multiplies it
    (:func:`protected_input`), for layer ``layer`` of each GNN that ``net.gnn_inputs(data)``
    names (``gnn`` of :class:`~fedlightning.models.MultimodalGNN`, ``gnns.<m>`` of each
    tower of :class:`~fedlightning.models.cross_modal.CrossModalGNN`): for a GCN layer
    ``<gnn>.convs.L.lin.weight``, for a SAGE layer ``<gnn>.convs.L.lin_l.weight`` and
    ``<gnn>.convs.L.lin_r.weight``.
    """
    out = {}
    for name, x in net.gnn_inputs(data).items():
        gnn = net.get_submodule(name)
        at = layer % len(gnn.convs)
        h = gnn.forward_until(x, data.edge_index, at)
        inp = protected_input(gnn.convs[at], h, data.edge_index)
        prefix = f"{name}.convs.{at}."
        if isinstance(inp, dict):
            out.update({f"{prefix}{k}.weight": v for k, v in inp.items()})
        else:
            out[f"{prefix}lin.weight"] = inp
    return out


def protected_biases(net: nn.Module, layer: int = -1) -> list[str]:
    """The biases of the protected layer of every GNN of ``net`` (frozen after the first
    stage)."""
    own = dict(net.named_parameters())
    names = []
    for name, gnn in net.named_modules():
        if isinstance(gnn, GNNEncoder):
            at = layer % len(gnn.convs)
            names += [f"{name}.convs.{at}.bias", f"{name}.convs.{at}.lin_l.bias"]
    return [n for n in names if n in own]
