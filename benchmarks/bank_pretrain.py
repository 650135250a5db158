"""Pre-training throughput of the temporal bank against a plain-torch loop, side by side.

Both stream the same pre-training events through the same PyG modules (TGNMemory,
LastNeighborLoader, TransformerConv) with the same batch size and Adam step. The plain loop
is the textbook TGN loop: uniform negatives, no bookkeeping. The platform's path adds the
Eq. (9) filter, the frequency/recency statistics and the event-number map of the bank.
Interleaved, median over repeats, events per second.

    python benchmarks/bank_pretrain.py [--dataset synthetic|wikipedia] [--events 20000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from fedlightning.data.temporal import load_wikipedia_txt, make_synthetic_stream
from fedlightning.temporal.bank import (
    BankConfig,
    PretrainNegatives,
    make_encoder,
    pretraining_loss,
    stream_and_validate,
)


def plain_loop(enc, stream, idx: np.ndarray, batch_size: int, opt, rng) -> None:
    """The same modules in a bare loop: embed, Eq. (10), step, ingest; uniform negatives."""
    t_all = enc.state.event_t
    msg_all = enc.state.event_msg
    items = (
        np.flatnonzero(stream.node_type == 1) if stream.bipartite else np.arange(stream.num_nodes)
    )
    for start in range(0, len(idx), batch_size):
        b = torch.from_numpy(idx[start : start + batch_size])
        src, dst = torch.from_numpy(stream.src[b.numpy()]), torch.from_numpy(stream.dst[b.numpy()])
        t, msg = t_all[b].long(), msg_all[b]
        j = torch.from_numpy(rng.choice(items, size=len(b)))
        h = enc.embed(torch.cat([src, dst, j]), torch.cat([t, t, t]))
        hu, hi, hj = h.split(len(b))
        loss = pretraining_loss(hu, hi, hj, 0.1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        enc.ingest(src, dst, t, msg, b)
        enc.detach()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="synthetic", choices=["synthetic", "wikipedia"])
    ap.add_argument("--events", type=int, default=20000, help="pre-training events per pass")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--encoder", default="tgn", choices=["tgn", "tgat"])
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.dataset == "wikipedia":
        root = os.environ.get("FEDLIGHTNING_DATA", "data")
        stream = load_wikipedia_txt(f"{root}/temporal/ml_wikipedia.txt")
    else:
        stream = make_synthetic_stream(num_users=500, num_items=100, num_events=args.events, seed=0)
    idx = np.arange(min(args.events, stream.num_events))
    cfg = BankConfig(encoder=args.encoder)
    rates: dict[str, list[float]] = {"plain torch": [], "fedlightning bank": []}
    for r in range(args.repeats + 1):  # the first round warms up and is not counted
        for name in rates:
            torch.manual_seed(0)
            enc = make_encoder(stream, cfg)
            enc.train()
            opt = torch.optim.Adam(enc.parameters(), lr=cfg.lr)
            rng = np.random.default_rng(r)
            if name == "plain torch":
                t0 = time.perf_counter()
                plain_loop(enc, stream, idx, cfg.batch_size, opt, rng)
                seconds = time.perf_counter() - t0
            else:

                def step(loss, opt=opt):
                    opt.zero_grad()
                    loss.backward()
                    opt.step()

                negatives = PretrainNegatives(stream, filtered=True)
                # timed: the pre-training pass (the bank's events_per_s); one batch is then
                # validated, untimed
                val = idx[-cfg.batch_size :]
                _, seconds, _, _ = stream_and_validate(
                    enc, stream, idx, val, cfg, 0, negatives, rng, name, step
                )
            if r:
                rates[name].append(len(idx) / seconds)
    base = statistics.median(rates["plain torch"])
    print(
        f"{args.encoder} on {stream.name}, {len(idx)} events, batch {cfg.batch_size}, "
        f"{torch.get_num_threads()} thread(s), median of {args.repeats}"
    )
    for name, v in rates.items():
        med = statistics.median(v)
        print(f"{name:<18} {med:10.0f} events/s   {base / med:5.2f}x the plain loop's time")


if __name__ == "__main__":
    main()
