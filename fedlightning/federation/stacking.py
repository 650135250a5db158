"""Stacked execution of graph clients (``runner.stack_clients``, docs/scaling.md): a round's
clients fitted as one LightningModule, and the global model evaluated on every client in
one pass.

A fit of ``K`` clients runs the runner's own executor (the same hooks and callbacks as a
one-client fit) on :class:`StackedClients`: a stack of ``K`` copies of the client module's
net (:func:`~fedlightning.models.stacked.stack_net`) over the disjoint union of the
clients' batches. The loss is the *sum* of the clients' own losses (each one's
:meth:`objective`, a mean over its nodes, plus its proximal term), so the gradient of copy
``k`` is client ``k``'s gradient alone; with an optimizer whose update is elementwise
(:data:`ELEMENTWISE`) one optimizer over the stack is ``K`` independent optimizers. Dropout
draws client ``k``'s rows from the stream ``torch.manual_seed(seeds[k])`` starts, in its
own fit's order, so a client's masks are those of its one-at-a-time fit.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from fedlightning.clients.losses import proximal_term
from fedlightning.errors import ConfigError
from fedlightning.models.constant import kept_output
from fedlightning.models.stacked import (
    Segments,
    copy_state,
    load_copies,
    seeded_streams,
    stack_net,
)

#: Optimizers whose update of a parameter entry reads only that entry's gradient and state
#: (plus step counters that every client shares): one of them over a stack is exact.
ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
)

_STACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (``None`` on another C library)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def release_freed_memory() -> None:
    """Hand the C allocator's freed heap memory back to the system (glibc's
    ``malloc_trim(0)``; nothing elsewhere). A stacked fit or evaluation calls it once its
    union is bound, the previous one freed, and once it is done: blocks of a few MiB that glibc keeps on its
    heap after a stage's tensors are freed (below its mmap threshold, which rises to 32 MiB)
    would otherwise stay resident under the next fit's peak (docs/scaling.md, "Memory")."""
    if _TRIM is not None:
        _TRIM(0)


def cached_stack(net: nn.Module, copies: int, role: str = "fit") -> tuple[nn.Module, Segments]:
    """A stack of ``copies`` copies of ``net`` for ``role`` (``fit``, ``teacher``, ``eval``),
    built once per net and size (its weights are set by whoever uses it)."""
    stacks = _STACKS.setdefault(net, {})
    if (copies, role) not in stacks:
        stacks[(copies, role)] = stack_net(net, copies)
    return stacks[(copies, role)]


def defined_by(obj: Any, name: str) -> type:
    """The class of ``obj``'s type hierarchy that defines attribute ``name`` (the first of
    its method resolution order)."""
    return next(c for c in type(obj).__mro__ if name in vars(c))


def why_not_stacked(algorithm: Any, module: pl.LightningModule) -> str:
    """Why ``algorithm``'s clients cannot fit as one stack with ``module`` (``""``: they
    can): the method declares no ``local_fit_share``, the module is not ``stackable``, the
    net cannot be stacked exactly, or the optimizer is not :data:`ELEMENTWISE`."""
    if algorithm.local_fit_share is None:
        return f"{type(algorithm).__name__} has no local_fit_share"
    fit, share = defined_by(algorithm, "local_fit"), defined_by(algorithm, "local_fit_share")
    if fit is not share and issubclass(fit, share):  # the share would skip the override
        return f"{fit.__name__} overrides local_fit but not local_fit_share"
    if not getattr(module, "stackable", False):
        return f"{type(module).__name__} is not stackable"
    try:
        cached_stack(module.net, 1)
    except ValueError as e:
        return str(e)
    probe = module.optimizer_factory([nn.Parameter(torch.zeros(1))])
    if type(probe) not in ELEMENTWISE:
        return f"{type(probe).__name__} is not an elementwise optimizer"
    return ""


class _Rows:
    """Rows ``a:b`` of a union's node attributes: one client's batch as its objective reads
    it (``batch.y``, ``batch.train_mask``, ``batch["sup_mask"]``, ...)."""

    def __init__(self, union: Any, a: int, b: int) -> None:
        self._union, self._a, self._b = union, a, b

    def __getattr__(self, name: str) -> Any:
        return getattr(self._union, name)[self._a : self._b]

    def __getitem__(self, name: str) -> Any:
        return self._union[name][self._a : self._b]


class StackedClients(pl.LightningModule):
    """``K`` clients' local training as one module: the stack ``net``, the union batch, the
    loss :math:`\\sum_k (\\ell_k + \\frac{\\mu}{2}\\lVert w_k - w^t\\rVert^2)` with
    :math:`\\ell_k` the client module's :meth:`objective` on client ``k``'s rows.

    Args:
        module: the client LightningModule (a :class:`~fedlightning.clients.NodeClassifier`),
            whose objective, proximal coefficient and anchor are used.
        net, segments: the stack of its net and its rows.
        teacher: a stack of the clients' frozen teachers (eval mode), or ``None``.
        teacher_sources: the clients' teacher state dicts loaded into ``teacher``.
    """

    def __init__(
        self,
        module: pl.LightningModule,
        net: nn.Module,
        segments: Segments,
        teacher: nn.Module | None = None,
        teacher_sources: Sequence[dict[str, Tensor]] = (),
    ) -> None:
        super().__init__()
        self.net = net
        self.client = [module]  # lists: neither is a submodule of the stack
        self.teacher = [teacher] if teacher is not None else []
        self.teacher_sources = list(teacher_sources)  # the state dicts loaded into it
        self.segments = segments
        self.anchor: dict[str, Tensor] = dict(getattr(module, "anchor", {}))
        self.losses: list[float] = []

    def on_fit_start(self) -> None:
        """Move the anchor, the teacher and the module's class ids to the fit's device."""
        dev, m = self.device, self.client[0]
        self.anchor = {k: v.to(dev) for k, v in self.anchor.items()}
        for t in self.teacher:
            t.to(dev)
        for name in ("known", "teacher_known"):
            if isinstance(getattr(m, name, None), Tensor):
                setattr(m, name, getattr(m, name).to(dev))

    def training_step(self, batch: Any, batch_idx: int = 0) -> Tensor:
        m = self.client[0]
        teacher = None
        if self.teacher:  # frozen: computed once per stage's union (kept_output), and before
            # the student's pass, whose saved activations would lie under the teacher's pass
            teacher = kept_output(self.teacher[0], batch, self.teacher_sources)
        logits = self.net(batch)
        mu = float(getattr(m, "prox_mu", 0.0))
        copies = {n: p.unbind(0) for n, p in self.net.named_parameters()} if mu > 0 else {}
        losses = []
        rows = self.segments.split(logits)
        olds = self.segments.split(teacher) if teacher is not None else [None] * len(rows)
        for k, a, b in self.segments.ranges():
            loss = m.objective(rows[k], _Rows(batch, a, b), olds[k])
            if mu > 0:
                own = ((n, ps[k]) for n, ps in copies.items())
                loss = loss + proximal_term(own, self.anchor, mu)
            losses.append(loss)
        self.losses = [float(v.detach()) for v in losses]
        return torch.stack(losses).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        opt = self.client[0].optimizer_factory(self.parameters())
        if type(opt) not in ELEMENTWISE:
            raise ConfigError(
                "runner.stack_clients",
                f"stacked clients need an elementwise optimizer ({', '.join(o.__name__ for o in ELEMENTWISE)}); "
                f"got {type(opt).__name__}: set runner.stack_clients=false",
            )
        return opt


def cut_rows(value: Any, a: int, b: int) -> Any:
    """Rows ``a:b`` of every tensor in ``value`` (a tensor ``[N, ...]``, or a tuple, list or
    dict of them)."""
    if isinstance(value, Tensor):
        return value[a:b]
    if isinstance(value, dict):
        return {k: cut_rows(v, a, b) for k, v in value.items()}
    return type(value)(cut_rows(v, a, b) for v in value)


@dataclass
class StackedFit:
    """The result of :func:`fit_stacked`: the trained stack, each client's loss and random
    stream after its fit, the stack's rows and the union it was fitted on."""

    net: nn.Module
    losses: list[float]
    streams: list[dict[str, Tensor]] = field(default_factory=list)
    segments: Segments | None = None
    union: Any = None

    @torch.no_grad()
    def outputs(self, fn: Callable[[nn.Module, Any], Any]) -> list[Any]:
        """``fn(net, batch)`` of each client after its fit, in eval mode, as one pass of
        ``fn`` on the union (its fitted copy on its own rows: the products its own net
        computes on its batch); each client's rows cut back, in order."""
        training = self.net.training
        self.net.eval()
        try:
            out = fn(self.net, self.union)
        finally:
            self.net.train(training)
            release_freed_memory()
        return [cut_rows(out, a, b) for _, a, b in self.segments.ranges()]

    def load(self, module: pl.LightningModule, k: int) -> pl.LightningModule:
        """Put client ``k``'s weights and loss into the client ``module`` and torch's CPU
        generator where client ``k``'s own fit leaves it; returns ``module``."""
        module.net.load_state_dict(copy_state(self.net, k))
        module.last_loss = self.losses[k]
        torch.set_rng_state(self.streams[k]["cpu"])
        return module


def fit_stacked(
    module: pl.LightningModule,
    batches: Sequence[Any],
    executor: Any,
    epochs: int,
    callbacks: Sequence[pl.Callback],
    seeds: Sequence[int],
    teachers: Sequence[dict[str, Tensor]] | None = None,
    starts: Sequence[dict[str, Tensor]] | None = None,
) -> StackedFit:
    """Fit ``len(batches)`` clients at once: client ``k`` on ``batches[k]`` from the weights
    ``starts[k]`` (``None``: every copy from ``module.net``'s current weights, the received
    broadcast), its dropout seeded by ``seeds[k]``, its teacher (if any) ``teachers[k]``."""
    copies = len(batches)
    net, segments = cached_stack(module.net, copies)
    if starts is None:
        starts = [{n: p.detach() for n, p in module.net.named_parameters()}] * copies
    load_copies(net, starts)
    union = segments.bind(batches)
    release_freed_memory()
    teacher = None
    if teachers is not None:
        teacher, tseg = cached_stack(module.net, copies, "teacher")
        load_copies(teacher, teachers)
        tseg.ptr = list(segments.ptr)  # the fit's union: the teacher reads the same rows
        teacher.eval()
    segments.streams = seeded_streams(seeds, getattr(executor, "device", None))
    stacked = StackedClients(module, net, segments, teacher, teachers or ())
    try:
        executor.fit(stacked, union, epochs, callbacks)
    finally:
        streams, segments.streams = segments.streams, None
        if teacher is not None:
            teacher.cpu()  # as the executor returns the stack to the CPU
        release_freed_memory()  # the steps' activations, before what comes next
    return StackedFit(net, stacked.losses, streams, segments, union)


@torch.no_grad()
def outputs_in_one_pass(
    net: nn.Module,
    state: dict[str, Tensor],
    graphs: Sequence[Any],
    fn: Callable[[nn.Module, Any], Any],
) -> list[Any]:
    """``fn(net with state, graph)`` for every graph, computed as one pass of ``fn`` on their
    disjoint union (a stack whose copies all hold ``state``: each graph's rows get the
    products its own pass computes); every tensor of the result cut back per graph.
    ``fn`` returns a tensor ``[N, ...]`` or a tuple/dict of them."""
    stack, segments = cached_stack(net, len(graphs), "eval")
    for name, p in stack.named_parameters():  # the one state into every copy
        p.copy_(state[name].expand_as(p))
    union = segments.bind(graphs)
    release_freed_memory()
    stack.eval()
    out = fn(stack, union)
    release_freed_memory()  # the pass's intermediates, before the caller's next step
    return [cut_rows(out, a, b) for _, a, b in segments.ranges()]


@dataclass
class UnionEvaluate:
    """:class:`~fedlightning.federation.loop.LocalEvaluate` of every client in one pass: the
    first call evaluates all ``clients`` (:func:`outputs_in_one_pass`), each call returns
    one client's correct and total nodes per split."""

    module: pl.LightningModule
    global_state: dict[str, Tensor]
    clients: Sequence[Any]
    _done: dict[int, dict[str, int]] = field(default_factory=dict)

    def __call__(self, client: Any) -> dict[str, int]:
        if not self._done:
            graphs = [c.data for c in self.clients]
            logits = outputs_in_one_pass(
                self.module.net, self.global_state, graphs, lambda net, g: net(g)
            )
            for c, out in zip(self.clients, logits, strict=True):
                self._done[c.client_id] = self.module.split_counts(out.argmax(-1), c.data)
        return self._done[client.client_id]


def client_grads(pl_module: pl.LightningModule) -> list[dict[str, Tensor]]:
    """The gradients a per-client hook (an ``on_after_backward`` callback) edits, one
    ``{parameter name: gradient}`` per client, named as in the client's own net: one dict
    for a client module, ``K`` for a :class:`StackedClients` (copy ``k`` of each stacked
    gradient, a view). Editing them in place edits the stack's gradients, so a hook written
    for one client works unchanged on a stack (client ``k``'s corrections to the ``k``-th
    dict)."""
    grads = {n: p.grad for n, p in pl_module.net.named_parameters() if p.grad is not None}
    if not isinstance(pl_module, StackedClients):
        return [grads]
    return [{n: g[k] for n, g in grads.items()} for k in range(pl_module.segments.copies)]
