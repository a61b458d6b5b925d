"""The link between two ranks on this machine, as tiergen's parallel runs use it: gloo over
loopback. Times a point-to-point round trip (pipeline stages pass hidden states and tokens
this way) and an all-reduce (tensor-parallel shards join after every attention and MLP) for
a decode-sized message (one row of a 576-wide hidden state) and a batch-sized one.

    python benchmarks/bench_link.py [--iters 500]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from datetime import timedelta

SIZES = {"1 x 576 floats (2 KB)": 576, "32 x 576 floats (74 KB)": 32 * 576,
         "1 MB": 1 << 18}


def rank_main(rank: int, port: int, iters: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    for name, n in SIZES.items():
        x = torch.randn(n)
        for _ in range(10):
            dist.all_reduce(x)
        t = time.perf_counter()
        for _ in range(iters):
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                dist.send(x, 0)
        trip = (time.perf_counter() - t) / iters
        t = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        reduce = (time.perf_counter() - t) / iters
        if rank == 0:
            print(f"| {name} | {trip * 1e6:.0f} | {reduce * 1e6:.0f} |", flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=29517, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank is not None:
        rank_main(a.rank, a.port, a.iters)
        return
    from bench_scale import machine

    print(machine())
    print("two processes, one thread each, gloo over loopback")
    print("| message | round trip (send + recv back) us | all-reduce us |")
    print("|---|---|---|")
    other = subprocess.Popen([sys.executable, __file__, "--rank", "1", "--port", str(a.port),
                              "--iters", str(a.iters)])
    rank_main(0, a.port, a.iters)
    other.wait()


if __name__ == "__main__":
    main()
