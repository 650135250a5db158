"""One net's copies for several clients, applied to the disjoint union of their graphs.

A *stack* of ``K`` copies of a net (:func:`stack_net`) has the net's parameter names, each
with a leading axis ``K`` (copy ``k`` is client ``k``'s weights). Its input is the disjoint
union of the clients' graphs (:func:`disjoint_union`), client ``k``'s nodes at rows
``ptr[k]:ptr[k+1]``. What has weights acts per client, on that client's rows alone, with
exactly the product one client's net computes (:class:`SegmentLinear`,
:class:`SegmentGCNConv`); what has none (ReLU, fusion, message passing over the union's
edges, which never cross clients) acts on the union at once. Dropout draws each client's
rows from that client's own random stream (:class:`SegmentDropout`), in the order its own
fit would. So copy ``k``'s outputs and gradients are those of client ``k``'s net alone:
they never depend on another client's rows or weights.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.data import Batch, Data
from torch_geometric.nn import GCNConv
from torch_geometric.nn.conv.gcn_conv import gcn_norm
from torch_geometric.nn.dense.linear import Linear as PygLinear

from fedlightning.models.constant import graphs_identity, kept_gcn_norm, unchanged
from fedlightning.models.dropout import (
    InputDropout,
    PackedMask,
    drawn_as_torch,
    dropout,
    dropout_keep,
    keep_scale,
    nonzero_dropout,
    nonzero_keep,
    nonzero_positions,
    nonzeros,
    scaled,
)
from fedlightning.models.multimodal import ModalityEncoders
from fedlightning.models.sparse import _SparseAffine
from fedlightning.utils.seeding import manual_seed


class GatheredRows:
    """Node features given as rows of other tensors, not gathered: part ``k`` is
    ``source_k[index_k]`` (a stage batch's rows of its client's features), the whole the
    parts' rows one after the other. :class:`SegmentEncoders` gathers one part at a time
    inside its first linear map (:class:`_DropAffine`), so a stack's union of stage batches
    never holds a copy of the features; anything else reads :meth:`materialize`."""

    def __init__(self, parts: Sequence[tuple[Tensor, Tensor]]) -> None:
        self.parts = list(parts)
        self.positions: dict[float, list] = {}  # max_density -> per part (SegmentDropout)

    def __len__(self) -> int:
        return sum(int(index.numel()) for _, index in self.parts)

    def part(self, k: int) -> Tensor:
        """Part ``k``'s rows, gathered (a new contiguous tensor)."""
        source, index = self.parts[k]
        return source.index_select(0, index)

    def materialize(self) -> Tensor:
        """Every part's rows in one tensor (what a gathered copy would hold)."""
        if len(self.parts) == 1:
            return self.part(0)
        return torch.cat([self.part(k) for k in range(len(self.parts))])

    def __repr__(self) -> str:  # what graphs_identity compares: the sources and their versions
        seen = ", ".join(f"{id(s):x}:{s._version}/{id(i):x}:{i._version}" for s, i in self.parts)
        return f"GatheredRows({seen})"


class Segments:
    """The rows of each copy in the union (``ptr`` ``[K+1]``) and, while a fit runs, each
    copy's random stream (torch's CPU generator state, and the CUDA one when used)."""

    def __init__(self, copies: int) -> None:
        self.copies = copies
        self.ptr: list[int] = []
        self.streams: list[dict[str, Tensor]] | None = None
        self._cut: list[tuple[Tensor, list[Tensor]]] = []  # sparse tensors and their rows
        self._dense: dict[int, tuple[Tensor, list[Tensor]]] = {}  # union attribute -> graphs'
        self._dropped: dict[tuple, Any] = {}  # an input's positions per copy, its buffer
        self._bound: tuple[list, Data] | None = None  # the graphs' identity, their union

    def ranges(self) -> Iterator[tuple[int, int, int]]:
        if len(self.ptr) != self.copies + 1:
            raise RuntimeError(f"the stack holds {self.copies} copies; set {self.copies + 1} ptr")
        for k in range(self.copies):
            yield k, self.ptr[k], self.ptr[k + 1]

    def split(self, x: Tensor) -> list[Tensor]:
        """Each copy's rows of ``x`` (views of a dense ``x``, whose gradients come back as
        one concatenation; row blocks of a sparse COO ``x``, cut once)."""
        if x.layout != torch.sparse_coo:
            return list(x.split([b - a for _, a, b in self.ranges()]))
        for whole, parts in self._cut:
            if whole is x:
                return parts
        parts = [x.narrow_copy(0, a, b - a) for _, a, b in self.ranges()]
        return self.remember(x, parts)

    def join(self, parts: list[Tensor]) -> Tensor:
        """The copies' rows back as one tensor (a sparse one remembers its rows)."""
        out = torch.cat(parts)
        if out.layout == torch.sparse_coo:
            self.remember(out, parts)
        return out

    def remember(self, x: Tensor, parts: list[Tensor]) -> list[Tensor]:
        """Keep ``parts`` as the rows of the sparse ``x`` (the last few such tensors)."""
        self._cut = [*self._cut[-7:], (x, parts)]
        return parts

    def bind(self, graphs: Sequence[Data]) -> Data:
        """The disjoint union of ``graphs`` as this stack's input: ``ptr`` set, and each
        sparse or dense floating node attribute's rows known to be the graphs' own tensors.
        The same graphs again, none of their tensors replaced or changed in place (a round's
        clients, round after round), give the union already built."""
        if self._bound is not None and unchanged(self._bound[0], graphs):  # the same, unchanged
            return self._bound[1]
        self._bound = None  # the previous union is freed before the next is built
        self._cut, self._dense, self._dropped = [], {}, {}
        union, self.ptr = disjoint_union(graphs)
        keys = [k for k, v in union.items() if _row_block(v, union.num_nodes)]
        share_rows(graphs, union, self.ptr, keys)
        self._bound = (graphs_identity(graphs), union)
        self._cut, self._dense, self._dropped = [], {}, {}
        for key, value in union.items():
            if isinstance(value, Tensor) and value.layout == torch.sparse_coo:
                self.remember(value, [g[key] for g in graphs])
            elif isinstance(value, Tensor) and value.is_floating_point() and value.dim() == 2:
                self._dense[id(value)] = (value, [g[key] for g in graphs])
        return union

    def input_positions(self, x: Tensor, max_density: float) -> list | None:
        """For ``x``, a dense node attribute of the bound union (constant data, on the CPU):
        per copy, the flat positions of its rows' non-zeros in ``x`` with their values
        (:func:`~fedlightning.models.dropout.nonzero_positions`; ``None``: standard
        dropout), found once per graph tensor and reused by every step and round while the
        tensor is unchanged. ``None`` when ``x`` is not such an attribute."""
        entry = self._dense.get(id(x))
        if entry is None or entry[0] is not x or x.device.type != "cpu" or x.requires_grad:
            return None
        key = ("positions", id(x), max_density)
        if key not in self._dropped:
            width, parts = x[0].numel() if len(x) else 0, []
            for (_, a, b), own in zip(self.ranges(), entry[1], strict=True):
                if own.shape != (b - a, *x.shape[1:]):
                    return None
                pos, values = nonzeros(own, max_density)
                parts.append(None if pos is None else (pos + a * width, values))
            self._dropped[key] = parts
        return self._dropped[key]

    def input_plan(self, x: Tensor, max_density: float) -> tuple[Tensor, list] | None:
        """:meth:`input_positions` of ``x`` and a buffer holding ``x`` (made once per bind)
        that :class:`SegmentDropout` writes the dropped rows into."""
        parts = self.input_positions(x, max_density)
        if parts is None:
            return None
        key = (id(x), max_density)
        if key not in self._dropped:
            self._dropped[key] = x.clone(memory_format=torch.contiguous_format)
        return self._dropped[key], parts

    @contextlib.contextmanager
    def stream(self, k: int, device: torch.device) -> Iterator[None]:
        """Draw from copy ``k``'s stream: its saved state in, the advanced state back out."""
        state = self.streams[k]
        cuda = device.type == "cuda" and "cuda" in state
        torch.set_rng_state(state["cpu"])
        if cuda:
            torch.cuda.set_rng_state(state["cuda"], device)
        try:
            yield
        finally:
            state["cpu"] = torch.get_rng_state()
            if cuda:
                state["cuda"] = torch.cuda.get_rng_state(device)


def seeded_streams(seeds: Sequence[int], device: torch.device | None = None) -> list[dict]:
    """One stream per seed: the generator states ``torch.manual_seed(seed)`` leaves, on the
    CPU and on ``device`` when it is a CUDA device (``None``: the current CUDA device, when
    there is one; without its state a stack's CUDA draws come from the global generator).
    Each seed is set on the global generators (:func:`~fedlightning.utils.seeding.manual_seed`),
    the last one left there."""
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    out = []
    for s in seeds:
        manual_seed(s)
        state = {"cpu": torch.get_rng_state()}
        if device is not None and device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(device)
        out.append(state)
    return out


def _stacked_param(p: Tensor | None, copies: int) -> nn.Parameter | None:
    if p is None:
        return None
    return nn.Parameter(p.detach().unsqueeze(0).repeat(copies, *([1] * p.dim())).contiguous())


class SegmentLinear(nn.Module):
    """``K`` linear maps, copy ``k`` applied to rows ``ptr[k]:ptr[k+1]`` of a dense or sparse
    COO input with :func:`torch.nn.functional.linear` (the sparse path of
    :class:`~fedlightning.models.sparse.SparseLinear`); ``weight`` ``[K, out, in]``,
    ``bias`` ``[K, out]`` or ``None``."""

    def __init__(self, linear: nn.Module, segments: Segments) -> None:
        super().__init__()
        self.segments = [segments]  # a list: not a submodule
        self.weight = _stacked_param(linear.weight, segments.copies)
        self.bias = _stacked_param(getattr(linear, "bias", None), segments.copies)

    def forward(self, x: Tensor) -> Tensor:
        if x.layout != torch.sparse_coo and x.dim() == 2:
            return _SegmentAffine.apply(x, self.weight, self.bias, self.segments[0].ptr)
        ws = self.weight.unbind(0)  # one backward node that stacks the copies' gradients
        bs = self.bias.unbind(0) if self.bias is not None else [None] * len(ws)
        parts = []
        for k, xk in enumerate(self.segments[0].split(x)):
            if xk.layout == torch.sparse_coo:
                parts.append(_SparseAffine.apply(xk, ws[k], bs[k]))
            else:
                parts.append(F.linear(xk, ws[k], bs[k]))
        return torch.cat(parts)


def _blocks(ptr: Sequence[int]) -> list[slice]:
    return [slice(a, b) for a, b in zip(ptr[:-1], ptr[1:], strict=True)]


class _SegmentAffine(torch.autograd.Function):
    """Rows ``ptr[k]:ptr[k+1]`` of a dense 2-D ``x`` through copy ``k`` of ``weight``
    ``[K, out, in]`` and ``bias`` ``[K, out]`` (or ``None``), each block written in place
    of one output (no concatenation). Forward and backward make the calls autograd makes
    for ``F.linear`` on each block (``addmm``/``mm``; the weight's gradient ``g_k^T x_k``,
    the input's ``g_k W_k``, the bias's ``g_k.sum(0)``), so every value is bitwise theirs."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, ptr: list) -> Tensor:
        blocks = _blocks(ptr)
        out = x.new_empty((x.shape[0], weight.shape[1]))
        for k, rows in enumerate(blocks):
            if bias is None:
                torch.mm(x[rows], weight[k].t(), out=out[rows])
            else:
                torch.addmm(bias[k], x[rows], weight[k].t(), out=out[rows])
        ctx.save_for_backward(x, weight)
        ctx.blocks, ctx.has_bias = blocks, bias is not None
        return out

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = x.new_empty(x.shape)
            for k, rows in enumerate(ctx.blocks):
                torch.mm(g[rows], weight[k], out=gx[rows])
        if ctx.needs_input_grad[1]:
            gw = torch.stack([g[rows].t().mm(x[rows]) for rows in ctx.blocks])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = torch.stack([g[rows].sum(0) for rows in ctx.blocks])
        return gx, gw, gb, None


class _SegmentBias(torch.autograd.Function):
    """``x[rows of k] + bias[k]`` for every copy ``k``, into one output; the bias's
    gradient is each block's ``g_k.sum(0)``, as autograd reduces a broadcast add's."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, bias: Tensor, ptr: list) -> Tensor:
        ctx.blocks = _blocks(ptr)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        for k, rows in enumerate(ctx.blocks):
            torch.add(x[rows], bias[k], out=out[rows])
        return out

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        gb = torch.stack([g[rows].sum(0) for rows in ctx.blocks])
        return g.contiguous(), gb, None  # a strided g slows the message passing's gather


def segment_add(x: Tensor, bias: Tensor, segments: Segments) -> Tensor:
    """``x[rows of k] + bias[k]`` for every copy ``k``."""
    if x.dim() == 2 and x.layout == torch.strided:
        return _SegmentBias.apply(x, bias, segments.ptr)
    bs = bias.unbind(0)
    return torch.cat([xk + bs[k] for k, xk in enumerate(segments.split(x))])


class SegmentGCNConv(nn.Module):
    """:class:`~torch_geometric.nn.GCNConv`'s forward (``A_hat (x W_k^T) + b_k``) with per-copy
    ``lin.weight`` ``[K, out, in]`` and ``bias`` ``[K, out]``; the normalisation and the
    propagation run on the union (its components are the clients' graphs)."""

    def __init__(self, conv: GCNConv, segments: Segments) -> None:
        super().__init__()
        if conv.cached:
            raise ValueError("stacked clients need GCNConv(cached=False)")
        self.conv = [conv]  # its settings and propagate; its own weights are not used
        self.segments = [segments]
        self.lin = SegmentLinear(conv.lin, segments)
        self.bias = _stacked_param(conv.bias, segments.copies)

    def forward(self, x: Tensor, edge_index: Tensor, edge_weight: Tensor | None = None) -> Tensor:
        conv = self.conv[0]
        if conv.normalize:
            norm = (x.size(conv.node_dim), conv.improved, conv.add_self_loops, conv.flow, x.dtype)
            if edge_weight is None:  # the union's edges: the same tensor every step and round
                edge_index, edge_weight = kept_gcn_norm(edge_index, *norm)
            else:
                edge_index, edge_weight = gcn_norm(edge_index, edge_weight, *norm)
        h = self.lin(x)
        if conv.aggr == "add" and conv.flow == "source_to_target" and edge_weight is not None:
            out = _Propagate.apply(h, edge_index, edge_weight)
        else:
            out = conv.propagate(edge_index, x=h, edge_weight=edge_weight)
        return out if self.bias is None else segment_add(out, self.bias, self.segments[0])


#: Edges whose messages ``[edges, d]`` are formed at once by :class:`_Propagate`.
EDGES_PER_CHUNK = 1 << 16


class _Propagate(torch.autograd.Function):
    """GCN's propagation ``out_i = sum_{(j, i)} w_ji h_j`` (PyG's ``propagate`` with ``add``
    aggregation: the message ``w.view(-1, 1) * h.index_select(0, j)``, then
    ``scatter_add_`` into the targets) over :data:`EDGES_PER_CHUNK` edges at a time, into
    one output: the same additions in the same order, so bitwise PyG's, without the
    ``[edges, d]`` messages of the whole union (a GB at 4M edges and ``d = 64``). The
    backward is autograd's for those calls, chunked the same way: the gradient of the
    messages gathered at their targets, times ``w``, ``index_add_``-ed at their sources."""

    @staticmethod
    def forward(ctx: Any, h: Tensor, edge_index: Tensor, weight: Tensor) -> Tensor:
        out = h.new_zeros(h.shape)
        src, dst = edge_index[0], edge_index[1]
        for a in range(0, src.numel(), EDGES_PER_CHUNK):
            j, i = src[a : a + EDGES_PER_CHUNK], dst[a : a + EDGES_PER_CHUNK]
            msg = weight[a : a + EDGES_PER_CHUNK].view(-1, 1) * h.index_select(0, j)
            out.scatter_add_(0, i.view(-1, 1).expand_as(msg), msg)
        ctx.save_for_backward(edge_index, weight)
        return out

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        edge_index, weight = ctx.saved_tensors
        src, dst = edge_index[0], edge_index[1]
        gh = g.new_zeros(g.shape)
        for a in range(0, src.numel(), EDGES_PER_CHUNK):
            j, i = src[a : a + EDGES_PER_CHUNK], dst[a : a + EDGES_PER_CHUNK]
            gmsg = g.gather(0, i.view(-1, 1).expand(-1, g.shape[1]))
            gh.index_add_(0, j, gmsg * weight[a : a + EDGES_PER_CHUNK].view(-1, 1))
        return gh, None, None


class _Scaled(torch.autograd.Function):
    """``x * noise`` (a hidden dropout's product), whose backward keeps the noise's masks
    as bits (``keeps``, one :class:`~fedlightning.models.dropout.PackedMask` per copy's
    rows, ``noise = m / (1-p)``) instead of the float noise, and rebuilds it for the
    gradient ``g * noise``: the product autograd's ``mul`` makes, on the same values."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, noise: Tensor, keeps: list, p: float) -> Tensor:
        ctx.keeps, ctx.p, ctx.shape, ctx.dtype = keeps, p, noise.shape, noise.dtype
        return x * noise

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        noise = g.new_empty(ctx.shape, dtype=ctx.dtype)
        at = 0
        for keep in ctx.keeps:
            rows = keep.shape[0]
            noise[at : at + rows].copy_(keep.unpack()).div_(1.0 - ctx.p)
            at += rows
        return g * noise, None, None, None


class SegmentDropout(nn.Module):
    """A dropout module (:class:`torch.nn.Dropout` or
    :class:`~fedlightning.models.dropout.InputDropout`) drawn per copy: copy ``k``'s rows
    with copy ``k``'s stream (:attr:`Segments.streams`), as its own fit draws them; without
    streams, the module itself on the whole input (torch's global generator)."""

    def __init__(self, dropout: nn.Dropout, segments: Segments) -> None:
        super().__init__()
        self.p, self.segments = dropout.p, [segments]
        self.max_density = getattr(dropout, "max_density", None)  # InputDropout's
        self.train(dropout.training)

    def _drop(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        if self.max_density is not None:
            return nonzero_dropout(x, self.p, True, self.max_density, out)
        result = dropout(x, self.p)
        return result if out is None else out.copy_(result)

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0:
            return x
        seg = self.segments[0]
        if seg.streams is None:
            return self._drop(x)
        if x.layout != torch.sparse_coo and self.max_density is None and drawn_as_torch(x, self.p):
            noise = torch.empty_like(x)  # every copy's multiplier, one product: no concatenation
            keeps = []
            for k, block in enumerate(seg.split(noise)):
                with seg.stream(k, x.device):
                    keep = dropout_keep(block.shape, self.p)  # dropout_noise's draw
                block.copy_(keep).div_(1.0 - self.p)  # and its multiplier
                keeps.append(PackedMask(keep))
            return _Scaled.apply(x, noise, keeps, self.p)
        if x.layout == torch.sparse_coo or (x.requires_grad and torch.is_grad_enabled()):
            parts = []
            for k, xk in enumerate(seg.split(x)):
                with seg.stream(k, x.device):
                    parts.append(self._drop(xk))
            return seg.join(parts)
        plan = None
        if self.max_density is not None and self.p < 1:
            plan = seg.input_plan(x, self.max_density)
        if plan is not None:
            return self._drop_planned(x, *plan)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        for k, (xk, ok) in enumerate(zip(seg.split(x), seg.split(out), strict=True)):
            with seg.stream(k, x.device):
                self._drop(xk, ok)  # into client k's rows: no concatenation
        return out

    def masks(self, x: Tensor | GatheredRows) -> list | None:
        """The masks this input dropout draws for every copy's rows of ``x`` in this step,
        as :meth:`forward` draws them (the same streams, order and values), without the
        dropped input: per copy ``(keep, None)`` (standard dropout, ``keep`` the mask of its
        rows) or ``(keep, (positions, values))`` (its non-zeros' masks), each ``keep`` a
        :class:`~fedlightning.models.dropout.PackedMask` (bits: a 32nd of the input's
        float32 bytes, unpacked where it is applied). ``None``
        where :meth:`forward` takes another path (no streams, evaluation, a sparse or
        gradient-taking input, one not a bound union's: :meth:`Segments.input_positions`)."""
        seg = self.segments[0]
        gathered = isinstance(x, GatheredRows)
        probe = x.parts[0][0] if gathered and x.parts else x
        if (
            not self.training
            or self.max_density is None
            or not 0.0 < self.p < 1.0
            or seg.streams is None
            or not isinstance(probe, Tensor)
            or probe.layout != torch.strided
            or probe.dim() != 2
            or (not gathered and x.requires_grad and torch.is_grad_enabled())
            or (not gathered and not drawn_as_torch(x, self.p))  # nor is a row block of it
            or probe.device.type != "cpu"
            or probe.dtype not in (torch.float32, torch.float64)
        ):
            return None
        if gathered:
            parts = gathered_positions(x, seg, self.max_density)
        else:
            parts = seg.input_positions(x, self.max_density)
        if parts is None:
            return None
        out = []
        for k, a, b in seg.ranges():
            with seg.stream(k, probe.device):
                if parts[k] is None:
                    keep = dropout_keep((b - a, probe.shape[1]), self.p)
                else:
                    keep = nonzero_keep(parts[k][0].shape, self.p, probe)
            out.append((PackedMask(keep), parts[k]))  # kept as bits until the backward
            del keep
        return out

    def _drop_planned(self, x: Tensor, out: Tensor, parts: list) -> Tensor:
        """:func:`~fedlightning.models.dropout.nonzero_dropout` of every copy's rows of the
        constant input ``x`` into ``out`` (:meth:`Segments.input_plan`): the same values and
        draws, without finding the non-zeros again or copying the zeros (they are ``x``'s,
        already in ``out``: only the non-zero positions are written). ``out`` is reused by
        the next step; autograd refuses a backward through a graph it was written after."""
        seg, flat = self.segments[0], out.view(-1)
        blocks = seg.split(out)
        for k, xk in enumerate(seg.split(x)):
            with seg.stream(k, x.device):
                if parts[k] is None:  # too dense for the non-zero path: standard dropout
                    blocks[k].copy_(dropout(xk, self.p))
                else:
                    pos, values = parts[k]
                    flat[pos] = values * keep_scale(pos.shape, self.p, x)
        return out


def gathered_positions(x: GatheredRows, segments: Segments, max_density: float) -> list | None:
    """:meth:`Segments.input_positions` of gathered rows (one part per copy of
    ``segments``), found once per part from its gathered rows and kept with ``x``;
    ``None`` when the parts are not the copies' rows."""
    sizes = [b - a for _, a, b in segments.ranges()]
    if [int(i.numel()) for _, i in x.parts] != sizes:
        return None
    if max_density not in x.positions:
        parts = []
        for k, a, _ in segments.ranges():
            flat = x.part(k).reshape(-1)
            pos = nonzero_positions(flat, max_density) if flat.numel() else None
            parts.append(None if pos is None else (pos + a * x.parts[k][0].shape[1], flat[pos]))
        x.positions[max_density] = parts
    return x.positions[max_density]


def _dropped_rows(
    x: Tensor | GatheredRows,
    k: int,
    a: int,
    b: int,
    mask: Any,
    p: float,
    scratch: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Copy ``k``'s rows ``a:b`` of ``x`` after the input dropout drawn as ``mask``
    (:meth:`SegmentDropout.masks`; ``None``: no dropout): the values the unfused dropout
    writes for them (gathered rows: part ``k``, gathered here). With ``scratch``
    (:func:`_scratch`), the rows and the multiplier ``m / (1-p)`` are written into its two
    buffers, reused copy after copy, instead of new tensors: the same values."""
    n = b - a
    if isinstance(x, GatheredRows):
        source, index = x.parts[k]
        own = scratch is not None
        rows = torch.index_select(source, 0, index, out=scratch[0][:n]) if own else x.part(k)
    else:
        rows, own = x[a:b], False  # the data's rows: never written
    if mask is None:
        return rows
    keep, nonzero = mask
    keep = keep.unpack() if isinstance(keep, PackedMask) else keep
    if nonzero is None and scratch is None:  # dropout(x_k, p): x_k * (m / (1-p))
        return rows * scaled(keep, p, rows.dtype)
    if nonzero is None:
        noise = scratch[1][:n].copy_(keep).div_(1.0 - p)  # scaled(keep, p) in the buffer
        return rows.mul_(noise) if own else torch.mul(rows, noise, out=scratch[0][:n])
    pos, values = nonzero  # nonzero_dropout: the non-zeros' values * (m / (1-p))
    if not isinstance(x, GatheredRows):
        rows = rows.clone(memory_format=torch.contiguous_format)
    rows.view(-1)[pos - a * rows.shape[1]] = values * scaled(keep, p, rows.dtype)
    return rows


def _scratch(x: Tensor | GatheredRows, blocks: list[slice]) -> tuple[Tensor, Tensor]:
    """Two buffers as large as the largest copy's rows of ``x`` (:func:`_dropped_rows`)."""
    probe = x.parts[0][0] if isinstance(x, GatheredRows) else x
    rows = max((r.stop - r.start for r in blocks), default=0)
    return probe.new_empty((rows, probe.shape[1])), probe.new_empty((rows, probe.shape[1]))


class _DropAffine(torch.autograd.Function):
    """Input dropout and the first linear map in one step: copy ``k``'s rows of the data
    ``x`` (a tensor, or :class:`GatheredRows` gathered one copy at a time) dropped with its
    mask (:meth:`SegmentDropout.masks`; ``None``: not dropped), then through its weight, as
    :class:`_SegmentAffine` maps the dropped input. The backward recomputes each copy's
    dropped rows from ``x`` and the mask for the weight's gradient ``g_k^T x_k`` instead of
    keeping the dropped input (the size of the features; the masks are bits, a 32nd of
    it for float32): the same operations on the same values, so every output and gradient is bitwise
    the unfused one's. ``x`` takes no gradient (it is data)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor | GatheredRows,
        weight: Tensor,
        bias: Tensor | None,
        ptr: list,
        masks: list,
        p: float,
    ) -> Tensor:
        blocks = _blocks(ptr)
        like = x if isinstance(x, Tensor) else weight
        out = like.new_empty((ptr[-1], weight.shape[1]))
        scratch = _scratch(x, blocks)
        for k, rows in enumerate(blocks):
            xk = _dropped_rows(x, k, rows.start, rows.stop, masks[k], p, scratch)
            if bias is None:
                torch.mm(xk, weight[k].t(), out=out[rows])
            else:
                torch.addmm(bias[k], xk, weight[k].t(), out=out[rows])
            del xk  # one copy's dropped rows at a time, in the scratch buffers
        ctx.x, ctx.blocks, ctx.masks, ctx.p = x, blocks, masks, p  # x: constant data
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        gw = gb = None
        if ctx.needs_input_grad[1]:
            parts, scratch = [], _scratch(ctx.x, ctx.blocks)
            for k, rows in enumerate(ctx.blocks):
                xk = _dropped_rows(ctx.x, k, rows.start, rows.stop, ctx.masks[k], ctx.p, scratch)
                parts.append(g[rows].t().mm(xk))
                del xk
            gw = torch.stack(parts)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = torch.stack([g[rows].sum(0) for rows in ctx.blocks])
        return None, gw, gb, None, None, None


# an input this large drops and maps in one step (its masks kept, not its dropped copy);
# a smaller one takes the two plain steps, which are faster (the same values either way)
FUSE_MIN_BYTES = 64 * 2**20


class SegmentEncoders(nn.Module):
    """:class:`~fedlightning.models.multimodal.ModalityEncoders` of a stack (the same
    parameter names): each dense modality's input dropout and linear map as one step
    (:class:`_DropAffine`), which keeps the dropout's masks for the backward instead of the
    dropped input; otherwise (evaluation, a sparse input, no streams) the stacked dropout
    and linear layers one after the other."""

    def __init__(self, encoders: ModalityEncoders, segments: Segments) -> None:
        super().__init__()
        self.modalities = list(encoders.modalities)
        self.encoders = nn.ModuleDict(
            {m: SegmentLinear(lin, segments) for m, lin in encoders.encoders.items()}
        )
        self.dropout = SegmentDropout(encoders.dropout, segments)
        self.train(encoders.training)

    def forward(self, features: dict[str, Tensor]) -> list[Tensor]:
        return [torch.relu(self.encode(m, features[m])) for m in self.modalities]

    def encode(self, m: str, x: Tensor | GatheredRows) -> Tensor:
        """Modality ``m``'s linear map of its dropped input (Eq. (10)'s encoder)."""
        lin, drop = self.encoders[m], self.dropout
        seg = drop.segments[0]
        gathered = isinstance(x, GatheredRows)
        if gathered and [int(i.numel()) for _, i in x.parts] != [b - a for _, a, b in seg.ranges()]:
            x, gathered = x.materialize(), False  # not one part per copy
        big = gathered or x.numel() * x.element_size() >= FUSE_MIN_BYTES
        masks = drop.masks(x) if gathered or (big and x.dim() == 2) else None
        if masks is None and gathered and (not drop.training or drop.p == 0):
            masks = [None] * seg.copies  # no dropout: each copy's rows as they are
        if masks is None:
            return lin(drop(x.materialize() if gathered else x))
        return _DropAffine.apply(x, lin.weight, lin.bias, seg.ptr, masks, drop.p)


def _replacement(module: nn.Module, segments: Segments) -> nn.Module | None:
    if isinstance(module, ModalityEncoders) and type(module).forward is ModalityEncoders.forward:
        return SegmentEncoders(module, segments)
    if isinstance(module, GCNConv):
        return SegmentGCNConv(module, segments)
    if isinstance(module, nn.Linear | PygLinear):
        return SegmentLinear(module, segments)
    if isinstance(module, nn.Dropout | InputDropout):
        return SegmentDropout(module, segments)
    return None


def _swap(module: nn.Module, segments: Segments) -> None:
    for name, child in list(module.named_children()):
        new = _replacement(child, segments)
        if new is None:
            _swap(child, segments)
        else:
            setattr(module, name, new)


def stack_net(net: nn.Module, copies: int) -> tuple[nn.Module, Segments]:
    """A stack of ``copies`` copies of ``net`` (each one ``net``'s current weights) and its
    :class:`Segments`; the stack's parameters keep ``net``'s names.

    Raises ``ValueError`` for a net the stack cannot copy exactly: buffers, or weights
    outside ``nn.Linear``, PyG's ``Linear`` and ``GCNConv``.
    """
    if next(net.buffers(), None) is not None:
        raise ValueError(f"{type(net).__name__} has buffers; stacked clients need none")
    segments = Segments(copies)
    stack = copy.deepcopy(net)
    _swap(stack, segments)
    own = dict(net.named_parameters())
    got = dict(stack.named_parameters())
    if set(got) != set(own) or any(got[n].shape[1:] != p.shape for n, p in own.items()):
        odd = sorted(n for n in own if n not in got or got[n].shape[1:] != own[n].shape)
        raise ValueError(f"{type(net).__name__}: cannot stack the weights {odd}")
    return stack, segments


@torch.no_grad()
def load_copies(stack: nn.Module, states: Sequence[dict[str, Tensor]]) -> None:
    """Set copy ``k`` of every parameter to ``states[k][name]``."""
    for name, p in stack.named_parameters():
        p.copy_(torch.stack([s[name] for s in states]))


def copy_state(stack: nn.Module, k: int) -> dict[str, Tensor]:
    """Copy ``k`` of the stack as the plain net's state dict (detached, cloned)."""
    return {n: p.detach()[k].clone() for n, p in stack.named_parameters()}


def disjoint_union(graphs: Sequence[Data]) -> tuple[Data, list[int]]:
    """The disjoint union of ``graphs`` (node attributes concatenated, edges offset) and
    ``ptr``: graph ``k``'s nodes are rows ``ptr[k]:ptr[k+1]``.

    A :class:`GatheredRows` attribute (one part per graph) stays one: the graphs' parts in
    order (gathered where some graphs hold it as a tensor: :func:`gathered_alike`). A dense floating node attribute ``[n_k, d]`` (a modality's features: most of a graph's
    bytes) is joined by :func:`joined_rows`: when the graphs' tensors are already adjacent
    rows of one storage (:func:`share_rows` made them so), the union's is a view of it and
    nothing is copied; otherwise one concatenation, with no second transient copy (PyG's
    collation of the other attributes never sees them)."""
    graphs = gathered_alike(list(graphs))
    rows = [k for k, v in graphs[0].items() if _row_block(v, graphs[0].num_nodes)]
    rows = [k for k in rows if all(_row_block(g[k], g.num_nodes) for g in graphs)]
    gathered = [k for k, v in graphs[0].items() if isinstance(v, GatheredRows)]
    light = []
    for g in graphs:
        h = copy.copy(g)  # shallow: the graph keeps its attributes
        for k in rows + gathered:
            del h[k]
        h.num_nodes = g.num_nodes
        light.append(h)
    union = Batch.from_data_list(light)
    for k in rows:
        union[k] = joined_rows([g[k] for g in graphs])
    for k in gathered:  # still not gathered: one part per graph
        union[k] = GatheredRows([part for g in graphs for part in g[k].parts])
    return union, [int(v) for v in union.ptr]


def gathered_alike(graphs: list[Data]) -> list[Data]:
    """``graphs``, where an attribute is :class:`GatheredRows` in some of them and not in
    all, with those gathered (shallow copies of the graphs concerned)."""
    kinds: dict[str, set[bool]] = {}
    for g in graphs:
        for k, v in g.items():
            kinds.setdefault(k, set()).add(isinstance(v, GatheredRows))
    mixed = [k for k, seen in kinds.items() if seen == {True, False}]
    if not mixed:
        return graphs
    out = []
    for g in graphs:
        keys = [k for k in mixed if isinstance(g[k], GatheredRows)]
        if keys:
            g = copy.copy(g)
            for k in keys:
                g[k] = g[k].materialize()
        out.append(g)
    return out


def _row_block(value: Any, num_nodes: int | None) -> bool:
    """A dense floating 2-D node attribute (one row per node)."""
    return (
        isinstance(value, Tensor)
        and value.layout == torch.strided
        and value.is_floating_point()
        and value.dim() == 2
        and value.shape[0] == num_nodes
        and not value.requires_grad
    )


def joined_rows(parts: Sequence[Tensor]) -> Tensor:
    """``torch.cat(parts)`` of 2-D row blocks: a view of their storage when they are
    already its adjacent, contiguous rows (same dtype and device), else the concatenation."""
    first = parts[0]
    at, width = first.storage_offset(), first.shape[1]
    adjacent = all(
        p.is_contiguous()
        and p.dtype == first.dtype
        and p.device == first.device
        and p.shape[1] == width
        and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        for p in parts
    )
    for p in parts if adjacent else ():
        adjacent = adjacent and p.storage_offset() == at
        at += p.numel()
    if not adjacent or width == 0:
        return torch.cat(list(parts))
    n = sum(p.shape[0] for p in parts)
    return first.as_strided((n, width), (width, 1), first.storage_offset())


def owns_storage(x: Tensor) -> bool:
    """Whether ``x`` is the whole of its storage (no other tensor's rows live in it)."""
    return x.storage_offset() == 0 and x.untyped_storage().nbytes() == x.numel() * x.element_size()


def share_rows(
    graphs: Sequence[Data], union: Data, ptr: Sequence[int], keys: Sequence[str]
) -> None:
    """Give each graph's attribute ``key`` (of ``keys``) up to ``union``'s: graph ``k``'s
    tensor replaced, in the graph, by rows ``ptr[k]:ptr[k+1]`` of the union's, the same
    values, when it is a tensor of its own (:func:`owns_storage`) and the union's is another
    (not already a view of it). Its own copy is then freed with its last reference, so a
    client's features and the union they are fitted or evaluated on are one copy in memory,
    and the next union of the same graphs is a view (:func:`joined_rows`)."""
    for key in keys:
        whole = union[key]
        for g, a, b in zip(graphs, ptr[:-1], ptr[1:], strict=True):
            own = g[key]
            if not isinstance(own, Tensor) or own is whole or not owns_storage(own):
                continue
            if own.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr():
                continue
            g[key] = whole[a:b]
