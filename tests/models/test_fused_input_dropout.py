"""The stack's fused input dropout and first linear map (``SegmentEncoders``, ``_DropAffine``)
keeps the dropout's masks instead of the dropped input: its outputs, gradients and random
draws must be bitwise those of the unfused dropout-then-linear path and of each client's own
``ModalityEncoders`` on its rows."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch_geometric.data import Data

import fedlightning.models.stacked as stacked
from fedlightning.models import ModalityEncoders
from fedlightning.models.dropout import PackedMask
from fedlightning.models.stacked import SegmentDropout, SegmentEncoders, seeded_streams, stack_net

SIZES, SEEDS = [30, 0, 24, 17], [31, 32, 33, 34]
IN_DIMS = {"dense": 32, "words": 48}  # rows of 32/48 float32: 64-byte aligned blocks


class Net(nn.Module):
    """A net whose encoders a stack replaces (:func:`stack_net` swaps a net's children)."""

    def __init__(self, in_dims: dict[str, int] = IN_DIMS, dropout: float = 0.4) -> None:
        super().__init__()
        self.enc = ModalityEncoders(in_dims, hidden=16, dropout=dropout)

    def forward(self, features: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return self.enc(features)


def graphs() -> list[Data]:
    """Client graphs with a dense modality (standard dropout) and a sparse-valued dense one
    (the non-zero path), one client with no nodes."""
    out = []
    for i, n in enumerate(SIZES):
        g = torch.Generator().manual_seed(100 + i)
        words = (torch.rand(n, 48, generator=g) < 0.1).float() * torch.rand(n, 48, generator=g)
        out.append(Data(x_dense=torch.randn(n, 32, generator=g), x_words=words, num_nodes=n))
    return out


def run(stack, segments, union, upstream, steps: int = 2):
    """``steps`` forward/backward steps; each step's outputs, the weights' and biases'
    gradients, and the streams after them."""
    segments.streams = seeded_streams(SEEDS)
    got = []
    for _ in range(steps):
        stack.zero_grad()
        outs = stack({"dense": union.x_dense, "words": union.x_words})
        sum((o * upstream).sum() for o in outs).backward()
        grads = {n: p.grad.clone() for n, p in stack.named_parameters()}
        got.append(([o.detach().clone() for o in outs], grads))
    return got, [s["cpu"].clone() for s in segments.streams]


@pytest.fixture(autouse=True)
def fuse_every_input(monkeypatch):
    """These tiny inputs take the fused step (by default only inputs of 64 MiB or more)."""
    monkeypatch.setattr(stacked, "FUSE_MIN_BYTES", 0)


@pytest.mark.parametrize("threads", [1, 2])
def test_fused_input_dropout_is_the_unfused_path_bitwise(threads, monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        stack, segments = stack_net(Net(), len(SIZES))
        assert isinstance(stack.enc, SegmentEncoders)
        union = segments.bind(graphs())
        upstream = torch.randn(sum(SIZES), 16)
        fused, fused_streams = run(stack, segments, union, upstream)
        monkeypatch.setattr(SegmentDropout, "masks", lambda self, x: None)  # unfused
        plain, plain_streams = run(stack, segments, union, upstream)
    finally:
        torch.set_num_threads(before)
    for (fo, fg), (po, pg) in zip(fused, plain, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(fo, po, strict=True))
        assert fg.keys() == pg.keys() and all(torch.equal(fg[n], pg[n]) for n in fg)
    assert all(torch.equal(a, b) for a, b in zip(fused_streams, plain_streams, strict=True))


def test_fused_input_dropout_is_each_clients_own_encoders():
    """Copy ``k`` of the fused stack computes client ``k``'s own encoders on its own rows
    (its own seed): outputs, gradients and the generator's state after two steps."""
    torch.manual_seed(0)
    net = Net()
    stack, segments = stack_net(net, len(SIZES))
    own_graphs = graphs()
    union = segments.bind(own_graphs)
    upstream = torch.randn(sum(SIZES), 16)
    fused, streams = run(stack, segments, union, upstream)
    for k, (_, a, b) in enumerate(segments.ranges()):
        own = Net()
        own.load_state_dict(net.state_dict())
        torch.manual_seed(SEEDS[k])
        for outs, grads in fused:
            own.zero_grad()
            g = own_graphs[k]
            mine = own({"dense": g.x_dense, "words": g.x_words})
            sum((o * upstream[a:b]).sum() for o in mine).backward()
            assert all(torch.equal(o[a:b], m) for o, m in zip(outs, mine, strict=True)), k
            for n, p in own.named_parameters():
                assert torch.equal(grads[n][k], p.grad), (k, n)
        assert torch.equal(streams[k], torch.get_rng_state()), k


def test_fused_step_keeps_masks_not_the_dropped_input():
    """What the fused step's backward keeps: the data itself and the masks as bits, one
    per entry of a copy's rows (no tensor of the input's size besides the data)."""
    torch.manual_seed(0)
    stack, segments = stack_net(Net({"dense": 32}, dropout=0.5), 2)
    union = segments.bind([Data(x_dense=torch.randn(n, 32), num_nodes=n) for n in (20, 12)])
    segments.streams = seeded_streams([1, 2])
    out = stack({"dense": union.x_dense})[0]
    node = out.grad_fn.next_functions[0][0]  # relu's input: the fused step
    assert type(node).__name__ == "_DropAffineBackward"
    assert node.x is union.x_dense and not node.saved_tensors
    assert [keep.bits.nbytes for keep, _ in node.masks] == [20 * 32 // 8, 12 * 32 // 8]
    assert all(isinstance(keep, PackedMask) and nz is None for keep, nz in node.masks)


def test_packed_mask_holds_a_masks_bits():
    """A mask kept as bits: byte ``j`` holds entries ``8j..8j+7``, entry ``8j+i`` its bit
    ``i`` (little order), a last partial byte padded with zeros; unpacked, the mask."""
    keep = torch.tensor([[1, 0, 1, 1, 0, 0, 0, 1, 0], [1, 1, 0, 0, 0, 0, 0, 0, 1]]).bool()
    packed = PackedMask(keep)
    # entries 0-7: 1+4+8+128; 8-15: 0 (entry 8) + 2 + 4; 16-17: entry 17 -> bit 1
    assert packed.bits.tolist() == [141, 6, 2]
    back = packed.unpack()
    assert back.dtype == torch.bool and back.shape == keep.shape and torch.equal(back, keep)
    with pytest.raises(ValueError, match="CPU bool mask"):
        PackedMask(keep.float())


def test_a_small_input_takes_the_plain_steps(monkeypatch):
    """Below ``FUSE_MIN_BYTES`` the stack drops and maps in two plain steps (faster on a
    small input); above it, the fused step."""
    monkeypatch.setattr(stacked, "FUSE_MIN_BYTES", 20 * 32 * 4 + 1)  # the union's bytes + 1
    torch.manual_seed(0)
    stack, segments = stack_net(Net({"dense": 32}, dropout=0.5), 2)
    union = segments.bind([Data(x_dense=torch.randn(n, 32), num_nodes=n) for n in (12, 8)])
    segments.streams = seeded_streams([1, 2])
    node = stack({"dense": union.x_dense})[0].grad_fn.next_functions[0][0]
    assert type(node).__name__ != "_DropAffineBackward"
    monkeypatch.setattr(stacked, "FUSE_MIN_BYTES", 20 * 32 * 4)
    node = stack({"dense": union.x_dense})[0].grad_fn.next_functions[0][0]
    assert type(node).__name__ == "_DropAffineBackward"
