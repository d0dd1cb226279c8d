"""Step 01: process groups, ranks and collectives, the primitives DDP is built from.

`torchrun --nproc-per-node N` starts N copies (ranks); each reads RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT, joins a process group and calls collectives with the others. DDP
needs two: broadcast (rank 0's weights to all) and all-reduce (the sum of all ranks' gradients).

Run it:
    torchrun --standalone --nproc-per-node 2 01_torch_dist_allreduce.py  # CPU (gloo) or GPUs (nccl)
    python 01_torch_dist_allreduce.py                                     # a world of one
    torchrun --standalone --nproc-per-node 2 01_torch_dist_allreduce.py --bench  # bandwidth sweep

Look for: all_reduce(sum) gives N(N+1)/2 on N ranks (rank r starts with r + 1); the ring by hand
equals dist.all_reduce. --bench: why DDP sends buckets; the ring's speed (docs/steps.md, "01").

Read also: common.py (choose_device: this process's GPU, or the CPU).
"""

# The repository's checks and one-line errors (harness/__init__.py); a copied step runs without.
try: import harness  # noqa: E701, F401
except ModuleNotFoundError: pass  # noqa: E701
import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist

import common


def print_in_rank_order(rank: int, world_size: int, line: str) -> None:
    """Ranks print one after another (a barrier between turns) so the output reads as a table."""
    for turn in range(world_size):
        if turn == rank:
            print(line, flush=True)
        dist.barrier()


def show(rank, world_size, name, before, after):
    fmt = lambda t: "[" + ", ".join(f"{v:g}" for v in t.tolist()) + "]"  # noqa: E731
    print_in_rank_order(rank, world_size, f"rank {rank}/{world_size} {name:<16} "
                                          f"before={fmt(before)} after={fmt(after)}")


def demo_collectives(rank: int, world_size: int, device: torch.device) -> None:
    mine = torch.tensor([rank + 1.0, 10.0 * (rank + 1)], device=device)

    # all_reduce: every rank ends with the element-wise sum over all ranks, in place.
    total = mine.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    show(rank, world_size, "all_reduce(sum)", mine, total)

    # Averaging is how DDP combines gradients: ReduceOp.AVG, in one call, with NCCL and with
    # gloo on every torch this tutorial supports (measured on 2.8.0 and 2.15.0; on 2.7, gloo
    # raised "Cannot use ReduceOp.AVG with Gloo": code for it must sum, then divide).
    average = mine.clone()
    dist.all_reduce(average, op=dist.ReduceOp.AVG)
    show(rank, world_size, "all_reduce(avg)", mine, average)

    # broadcast: rank 0's tensor overwrites everyone's (how DDP makes the weights equal).
    copy = mine.clone()
    dist.broadcast(copy, src=0)
    show(rank, world_size, "broadcast(src=0)", mine, copy)

    # all_gather: every rank receives every rank's tensor, in rank order.
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    show(rank, world_size, "all_gather", mine, torch.cat(gathered))

    # barrier: no rank passes until all have arrived (print_in_rank_order uses it too).
    dist.barrier()


def ring_all_reduce(tensor: torch.Tensor, rank: int, world_size: int) -> None:
    """dist.all_reduce(SUM) written with sends and receives: the ring gloo runs (NCCL's, too,
    among the algorithms it chooses from).

    The tensor is cut into N chunks (unequal when N does not divide its length). Reduce-scatter:
    N-1 steps, at each every rank sends one chunk to its right neighbour and adds the one that
    arrives from its left; then rank r holds the whole sum of chunk r+1. All-gather: N-1 more
    steps pass the finished chunks on around the ring. Each rank sends 2(N-1) chunks of 1/N of
    the tensor: 2(N-1)/N times its size, for any N, where a tree or a star sends more.
    """
    chunks = tensor.tensor_split(world_size)  # views: writing them writes `tensor`
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for step in range(world_size - 1):  # reduce-scatter
        send, receive = (rank - step) % world_size, (rank - step - 1) % world_size
        chunks[receive].add_(exchange(chunks[send], chunks[receive], right, left))
    for step in range(world_size - 1):  # all-gather
        send, receive = (rank + 1 - step) % world_size, (rank - step) % world_size
        chunks[receive].copy_(exchange(chunks[send], chunks[receive], right, left))


def exchange(outgoing, like, right: int, left: int) -> torch.Tensor:
    """Send `outgoing` to the right and receive a tensor shaped `like` from the left: both
    posted, then both waited for. A blocking dist.send first on every rank would wait forever:
    gloo's send ends once the receiver has posted its receive (even 4 bytes; torch 2.14.1 and
    2.8.0). NCCL runs an unbatched isend, then irecv, in order on one stream (2.14.1 with
    device_id: one for all peers; 2.8.0: one per pair), so a send could wait for a receive
    queued behind the neighbour's own send. In one batch NCCL starts them together."""
    incoming = torch.empty_like(like)
    for request in dist.batch_isend_irecv([dist.P2POp(dist.irecv, incoming, left),
                                           dist.P2POp(dist.isend, outgoing, right)]):
        request.wait()
    return incoming


def demo_ring(rank: int, world_size: int, device: torch.device) -> None:
    """The ring against dist.all_reduce on 1001 numbers (2, 3 or 4 ranks get unequal chunks):
    integers, exact in any order of addition, then random floats, whose sums may round another
    way in another order. The line gives the largest difference over all ranks."""
    g = torch.Generator().manual_seed(rank)
    differences = []
    for data in (torch.randint(-1000, 1000, (1001,), generator=g).float(),
                 torch.randn(1001, generator=g)):
        ours, theirs = data.to(device, copy=True), data.to(device, copy=True)  # two tensors
        ring_all_reduce(ours, rank, world_size)
        dist.all_reduce(theirs)
        differences.append((ours - theirs).abs().max())
    largest = torch.stack(differences)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"ring all-reduce by hand (reduce-scatter, then all-gather: {2 * (world_size - 1)} "
              f"steps) of 1001 numbers on {world_size} rank(s): largest difference from "
              f"dist.all_reduce {largest[0].item():g} for integers, {largest[1].item():.3g} for "
              f"random floats", flush=True)


# Message sizes DDP sends (step 03): its first bucket, and every later one by default.
DDP_BUCKETS = {2**20: "<- DDP's first bucket", 25 * 2**20: "<- DDP's other buckets (default)"}


def bench_all_reduce(rank: int, world_size: int, device: torch.device, max_mb: int) -> None:
    """All-reduce time over message sizes, with bandwidths as nccl-tests define them.

    algbw = bytes / time. busbw = algbw x 2(n-1)/n, read off ring_all_reduce: each rank sends
    n-1 chunks of bytes/n in its reduce-scatter and n-1 more in its all-gather, so busbw compares
    with one link's speed for any n. Small messages cost a nearly fixed latency, large ones
    approach the link's bandwidth: why DDP sends gradients in buckets of megabytes rather than
    one per parameter. The last two columns: the same for ring_all_reduce, which sends a chunk
    whole, then adds it; gloo's ring sends pieces of at most 1 MiB while it adds the one before.
    """
    repeats, warmups = 5, 2
    if rank == 0:
        print(f"\nall_reduce of float32 on {world_size} rank(s), {device.type}, backend "
              f"{dist.get_backend()}; time per call: the median of {repeats} timings of "
              f"back-to-back calls\n(the slowest rank's), after {warmups} warm-up calls; the "
              f"ring by hand: of a quarter as many calls (Python drives each of its steps)\n"
              f"{'bytes':>12} {'size':>10} {'time (us)':>11} {'algbw GB/s':>11} "
              f"{'busbw GB/s':>11} {'ring (us)':>11} {'ring busbw':>11}", flush=True)
    largest = max_mb * 2**20
    sizes = {2**k for k in range(12, 33) if 2**k <= largest}  # 4 KiB, 8 KiB, ... 4 GiB
    ring = lambda x: ring_all_reduce(x, rank, world_size)  # noqa: E731
    bus_factor = 2 * (world_size - 1) / world_size  # (ring_all_reduce's docstring)
    for size in sorted(sizes | {s for s in DDP_BUCKETS if s <= largest}):
        # Zeros: a sum of ones would double with every call and overflow; speed is the same.
        data = torch.zeros(size // 4, dtype=torch.float32, device=device)
        calls = max(1, min(100, 2**24 // size))  # about 16 MiB per timing: small ones repeat
        for _ in range(warmups):  # first calls set up connections and buffers
            dist.all_reduce(data)
        ring(data)  # (a warm-up of ours too)
        seconds = per_call(dist.all_reduce, data, calls, repeats, device)
        ring_seconds = per_call(ring, data, max(1, calls // 4), repeats, device)
        algbw, ring_algbw = size / seconds / 1e9, size / ring_seconds / 1e9
        if rank == 0:
            label = f"{size // 2**20} MiB" if size >= 2**20 else f"{size // 1024} KiB"
            print(f"{size:>12} {label:>10} {seconds * 1e6:>11.1f} {algbw:>11.3f} "
                  f"{algbw * bus_factor:>11.3f} {ring_seconds * 1e6:>11.1f} "
                  f"{ring_algbw * bus_factor:>11.3f}  {DDP_BUCKETS.get(size, '')}".rstrip(),
                  flush=True)


def per_call(reduce, data, calls: int, repeats: int, device) -> float:
    """Seconds per call of reduce(data): `repeats` timings of `calls` calls each."""
    return slowest_median([timed(lambda: [reduce(data) for _ in range(calls)], device) / calls
                           for _ in range(repeats)], device)


def slowest_median(per_call: list, device) -> float:
    """The slowest rank decides how long a collective takes: the median of its timings."""
    slowest = torch.tensor(per_call, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.median().item()  # (of an odd count: the middle one)


def timed(fn, device) -> float:
    dist.barrier()  # every rank starts together
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # GPU work is asynchronous: wait before reading the clock
    return time.perf_counter() - start


@common.record  # torch's elastic @record: torchrun's failure summary names the error
def main():
    parser = common.Parser(description=__doc__, prog="01_torch_dist_allreduce.py",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--bench", action="store_true", help="time all_reduce over message sizes")
    parser.add_argument("--max-mb", type=int, default=64,
                        help="largest message in --bench (MiB)")
    args = parser.parse_args()

    # Who am I? torchrun sets these for every process it starts. Plain `python` sets none: a
    # world of one, which meets itself on this machine.
    rank = int(os.environ.get("RANK", 0))  # 0 .. world_size-1
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # which process on this machine
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # processes on this machine
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # where the group's store is hosted
    os.environ.setdefault("MASTER_PORT", "0")  # (0: any free port; plain python only)
    # One GPU per process, chosen by the rank on this node; NCCL between GPUs, gloo on CPUs.
    device = common.choose_device(args.device, local_rank, local_ranks)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this rank's GPU, before NCCL starts on it
    # Join the group: blocks until all world_size ranks have arrived at MASTER_ADDR:MASTER_PORT.
    # device_id lets NCCL connect at once (gloo needs none; 2.15 accepts cpu:0, 2.8 refuses it).
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120),
                            device_id=device if device.type == "cuda" else None)
    if rank == 0:
        print(f"{world_size} rank(s), backend {backend}, device type {device.type}", flush=True)

    demo_collectives(rank, world_size, device)
    demo_ring(rank, world_size, device)
    if args.bench:
        bench_all_reduce(rank, world_size, device, args.max_mb)
    dist.destroy_process_group()  # leave the group: every rank, at the end


if __name__ == "__main__":
    common.run_main(main)  # one-line errors instead of tracebacks
