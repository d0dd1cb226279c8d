"""Step 12 (side trip from 03): what to reduce when the ranks do not hold equal shares of a mean.

03's N ranks = one process holds because every rank holds as many images and the loss is their
mean. Four workloads break it; --bug NAME plants the usual mistake: tokens (padded lines: a mean
of per-rank token means), gather (a contrastive loss whose all_gather drops the gradient), uneven
(a rank with one batch more: a hang), outputs (a metric over every sample's output, with
DistributedSampler's padding). --fix fixes all four; docs/what-to-reduce.md explains each.

Run it (2 or more processes, on the CPU; each training part with 1, then 2 micro-batches):
    torchrun --standalone --nproc-per-node 2 12_what_to_reduce.py --bug tokens
    torchrun --standalone --nproc-per-node 3 12_what_to_reduce.py --fix --micro-batches 4

Look for: per part a "check" line, DDP against rank 0's replay as one process beside the rounding
of that replay with the ranks' samples reversed; then one "diagnosis:" line (exit 4) or "all four
hold" (exit 0). Then find the lines marked "BUG"."""
# The repository's checks and one-line errors (harness/__init__.py); a copied step runs without.
try: import harness  # noqa: E701, F401
except ModuleNotFoundError: pass  # noqa: E701
import argparse
import contextlib
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

import common

PARTS = ["tokens", "gather", "uneven", "outputs"]
PER_RANK = 4  # lines, pairs or samples per rank and step (--micro-batches 1, 2, 4 divide it)
PAD = -100  # cross_entropy's ignore_index: a padded position has no target
VOCAB, STEPS = 12, 3  # the language model's tokens; the steps of the uneven part's short ranks
EXIT_MISTAKE = 4  # the planted mistake showed (as in 11)


def setup():
    """The flags, then the group, joined as 05 on do, on the CPU (tiny tensors; gloo's timeout
    raises in Python, NCCL's ends the process: see 10): --timeout ends the planted hang. `proof`:
    for the step's own checks, which never pair with DDP's all-reduces, and wait twice as long."""
    parser = common.Parser(prog="12_what_to_reduce.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    choice = parser.add_mutually_exclusive_group(required=True)
    choice.add_argument("--bug", choices=PARTS, help="plant one part's mistake (that part alone)")
    choice.add_argument("--fix", action="store_true", help="all four parts, fixed and proven")
    parser.add_argument("--micro-batches", type=int, choices=[1, 2, 4], nargs="+",
                        default=[1, 2], help="accumulate over 1, 2 or 4 (default: 1, then 2)")
    parser.add_argument("--seed", type=int, default=0, help="the data's and the models' seed")
    parser.add_argument("--timeout", type=float, default=10, help="seconds a collective waits")
    args = parser.parse_args()
    if int(os.environ.get("WORLD_SIZE", 1)) < 2:  # checked before any work starts
        raise common.UserError("12 compares N ranks with one process: start 2 or more, e.g. torch"
                               "run --standalone --nproc-per-node 2 12_what_to_reduce.py --fix")
    args.device, args.deterministic, args.amp = "cpu", False, False
    run = common.setup_distributed(args)
    return args, run, dist.new_group(timeout=datetime.timedelta(seconds=2 * args.timeout))


def build(make, args):
    torch.manual_seed(args.seed)  # DDP's model and the replay's start equal
    return make()


def step(model, batch, micro: int, loss_of) -> None:
    """One step's backward over this rank's rows in `micro` micro-batches, as in 03."""
    parts = list(zip(*(t.chunk(micro) for t in batch)))
    for i, part in enumerate(parts):  # DDP all-reduces in the last backward only
        with model.no_sync() if i < len(parts) - 1 else contextlib.nullcontext():
            loss_of(*part).backward()


def verdict(kind: str, found: list, replay, note: str, advice: str) -> str:
    """Rank 0: DDP's numbers against one process's, and one process's against its control (the
    rounding of adding in another order). Off by more than 10x that + 1e-6: the diagnosis."""
    one, control = replay(False), replay(True)
    off, rounding = (max((a - b).abs().max().item() for a, b in zip(x, y))
                     for x, y in ((found, one), (one, control)))
    measured = f"{note}off by {off:.3g} from one process (rounding {rounding:.3g})"
    print(f"check {kind}: {measured}", flush=True)
    return f"{kind}: {measured}: {advice}" if off > 10 * rounding + 1e-6 else ""


def check_gradients(kind, make, data, ddp_loss, one_loss, micro, one_micro, args, run, advice):
    """DDP's gradients after one step over this rank's chunk of `data` (rank r holds the r-th)
    in `micro` micro-batches, against one process's over the global batch in `one_micro`."""
    model, world = DDP(build(make, args)), run.world_size
    step(model, [t.chunk(world)[run.rank] for t in data], micro, lambda *p: ddp_loss(model, *p))
    def replay(reverse):  # global micro-batch m: every rank's m-th (ranks reversed: the control)
        one, ranks = build(make, args), range(world)[::-1] if reverse else range(world)
        for m in range(one_micro):
            one_loss(one, *(torch.cat([t.chunk(world)[r].chunk(one_micro)[m] for r in ranks])
                            for t in data)).backward()
        return [p.grad for p in one.parameters()]
    return run.is_main and verdict(kind, [p.grad for p in model.parameters()], replay,
                                   "gradients ", advice)


# ---------------------------------------------------------------- tokens: padded lines
def tokens_part(args, run, proof, micro: int) -> str:
    """Lines of 2 to 16 tokens padded to 16 (token 0); each token predicts the next (PAD: none)."""
    generator = torch.Generator().manual_seed(args.seed)  # the same lines on every rank
    lengths = torch.randint(2, 17, (PER_RANK * run.world_size, 1), generator=generator)
    tokens = torch.randint(1, VOCAB, (len(lengths), 17), generator=generator)
    inputs = tokens[:, :16].where(torch.arange(16) < lengths, 0)
    targets = tokens[:, 1:].where(torch.arange(16) < lengths - 1, PAD)
    if args.bug == "tokens":
        # BUG tokens: 03's loss: each micro-batch's mean over its own real tokens, weighted by
        # its share of the lines; DDP averages the ranks. A mean of per-rank, per-micro-batch
        # means: a token where real tokens are few weighs more than one where they are many.
        def loss_of(model, x, y):
            return F.cross_entropy(model(x), y.flatten(), ignore_index=PAD) * len(y) / PER_RANK
    else:
        # Fix: the sum over the micro-batch's tokens, divided by the real tokens of the whole
        # step (every micro-batch of every rank: one all-reduce, before the first forward),
        # times the world size, which DDP divides the gradients' sum by.
        count = (targets.chunk(run.world_size)[run.rank] != PAD).sum()
        dist.all_reduce(count)
        def loss_of(model, x, y):
            return F.cross_entropy(model(x), y.flatten(), ignore_index=PAD,
                                   reduction="sum") * run.world_size / count
    return check_gradients(  # one process: one forward, the mean over every real token
        f"tokens, {micro} micro-batch(es)", lambda: nn.Sequential(
            nn.Embedding(VOCAB, 16), nn.Tanh(), nn.Linear(16, VOCAB), nn.Flatten(0, 1)),
        (inputs, targets), loss_of, lambda one, x, y: F.cross_entropy(
            one(x), y.flatten(), ignore_index=PAD), micro, 1, args, run,
        "a mean of per-rank, per-micro-batch token means: sum the loss over the tokens, divide "
        "by the step's real tokens over every rank and micro-batch, times the world size")


# ---------------------------------------------------------------- gather: a contrastive loss
class GatherWithGradient(torch.autograd.Function):
    """all_gather with a backward: every rank's loss sends a gradient to every rank's slice, so
    backward sums them over the ranks and keeps this rank's slice. A sum, not a mean: DDP divides
    by the world size once, after. (torch.distributed.nn.functional.all_gather sums too, 2.14.1.)"""
    @staticmethod
    def forward(ctx, z):
        parts = [torch.empty_like(z) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, z.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        summed = grad.contiguous().clone()  # (autograd's tensor: not ours to change in place)
        dist.all_reduce(summed)
        return summed.chunk(dist.get_world_size())[dist.get_rank()]


def info_nce(model, a, b, gather, first: int):
    """Each anchor in `a` must pick its own pair among every `b` of the global batch
    (temperature 0.1); `first`: where this rank's anchors start in it. One forward, both views."""
    za, zb = F.normalize(model(torch.cat([a, b])), dim=1).chunk(2)
    return F.cross_entropy(za @ gather(zb).T / 0.1, first + torch.arange(len(za)))


def gather_part(args, run, proof, micro: int) -> str:
    generator = torch.Generator().manual_seed(args.seed)
    x = torch.randn(PER_RANK * run.world_size, 8, generator=generator)
    a, b = (x + 0.3 * torch.randn(x.shape, generator=generator) for _ in range(2))  # two views
    gather = GatherWithGradient.apply  # Fix: a gather whose backward sums over the ranks
    if args.bug == "gather":
        # BUG gather: dist.all_gather's tensors carry no gradient. With this rank's own slot put
        # back (as many scripts do) its own loss reaches its embeddings, but the other ranks'
        # losses, which used them as negatives, send nothing back: one process's loss, not grad.
        def gather(z):
            parts = [torch.empty_like(z) for _ in range(run.world_size)]
            dist.all_gather(parts, z.detach().contiguous())
            parts[run.rank] = z
            return torch.cat(parts)
    return check_gradients(  # one process: the same global micro-batches
        f"gather, {micro} micro-batch(es)", lambda: nn.Sequential(
            nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)), (a, b),
        lambda model, xa, xb: info_nce(model, xa, xb, gather, run.rank * len(xa)) / micro,
        lambda one, xa, xb: info_nce(one, xa, xb, lambda z: z, 0) / micro, micro, micro, args,
        run, "dist.all_gather drops the gradient the other ranks' losses send to this rank's "
        "embeddings: gather with a backward that sums it over the ranks")


# ---------------------------------------------------------------- uneven: a stream, not divisible
def uneven_part(args, run, proof, micro: int) -> str:
    generator, world = torch.Generator().manual_seed(args.seed), run.world_size
    batches = STEPS * world + 1  # batch j goes to rank j % world: rank 0 gets one batch more
    x, y = (torch.randn(batches, PER_RANK, n, generator=generator) for n in (8, 1))
    model = DDP(build(lambda: nn.Linear(8, 1), args))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # BUG uneven: nothing evens the ranks out: rank 0's last step waits in DDP's gradient
    # all-reduce for ranks that have left the loop (a hang, until --timeout).
    # Fix: model.join(): a rank out of batches joins and shadows the others' collectives with
    # zero gradients; the sum is still divided by the world size (divide_by_initial_world_size,
    # its default in 2.14.1), so every sample weighs as much in the last step as in the others.
    trained = torch.tensor(0)  # samples this rank trained on
    try:
        with contextlib.nullcontext() if args.bug == "uneven" else model.join():
            for j in range(run.rank, batches, world):
                optimizer.zero_grad(set_to_none=True)
                step(model, (x[j], y[j]), micro,
                     lambda xb, yb: F.mse_loss(model(xb), yb) * len(yb) / PER_RANK)
                optimizer.step()
                trained += len(x[j])
        dist.all_reduce(trained, group=proof)  # (--bug uneven: the other ranks wait here)
    except RuntimeError as err:  # gloo raises once --timeout passed (or a peer left)
        if args.bug != "uneven":
            raise
        if run.is_main:
            torch_says = str(err).strip().splitlines()[0].split("] ")[-1]
            print(f"rank 0: {torch_says}\ndiagnosis: uneven: rank 0 held {STEPS + 1} batches, "
                  f"the others {STEPS}: its last step waited in DDP's all-reduce for ranks that "
                  f"had left the loop, until --timeout ({args.timeout:g} s): use model.join(), "
                  f"or cut every rank to as many batches", flush=True)
        os._exit(EXIT_MISTAKE)  # a gloo group whose collective failed cannot be destroyed (10)
    def replay(reverse):  # one process; step s takes batches s*world.. (those that exist)
        one = build(lambda: nn.Linear(8, 1), args)
        sgd = torch.optim.SGD(one.parameters(), lr=0.1)
        for present in zip(x.split(world), y.split(world)):
            xs, ys = (t.flip(0).flatten(0, 1) if reverse else t.flatten(0, 1) for t in present)
            sgd.zero_grad(set_to_none=True)
            (F.mse_loss(one(xs), ys, reduction="sum") / (world * PER_RANK)).backward()
            sgd.step()
        return list(one.parameters())
    return run.is_main and verdict(f"uneven, {micro} micro-batch(es)", list(model.parameters()),
                                   replay, f"trained {int(trained)} of the stream's "
                                   f"{batches * PER_RANK} samples; weights ", "join()")


# ---------------------------------------------------------------- outputs: every sample's output
def auroc(scores, labels) -> torch.Tensor:
    """P(a positive scores above a negative), ties half: no sum of per-rank parts gives it."""
    positive, negative = scores[labels == 1][:, None], scores[labels == 0]
    return (positive > negative).double().mean() + (positive == negative).double().mean() / 2


def gather_unequal(rows):
    """all_gather for shares of different lengths (gloo 2.14.1: "invalid tensor size")."""
    lengths = [torch.zeros((), dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(lengths, torch.tensor(len(rows)))
    padded = torch.cat([rows, rows.new_zeros(int(max(lengths)) - len(rows), rows.shape[1])])
    shares = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(shares, padded)
    return torch.cat([share[:n] for share, n in zip(shares, lengths)])


def outputs_part(args, run, proof) -> str:
    generator, world = torch.Generator().manual_seed(args.seed), run.world_size
    size = 10 * world + 1  # test samples: the world size does not divide them
    x = torch.randn(size, 8, generator=generator)
    labels = (x[:, 0] + torch.randn(size, generator=generator) > 0).double()
    scorer = build(lambda: nn.Linear(8, 1), args)  # any scorer will do: the metric is the point
    # Fix: an unpadded strided shard (some ranks hold one sample more), gathered as shares of
    # different lengths: every test sample exactly once.
    shard, gather = torch.arange(run.rank, size, world), gather_unequal
    if args.bug == "outputs":
        # BUG outputs: DistributedSampler pads every rank's share to one length (so that a plain
        # all_gather works) with samples from the start of the set: they are counted twice.
        shard = torch.tensor(list(DistributedSampler(range(size), world, run.rank, shuffle=False)))
    with torch.no_grad():  # each row: (sample, score, label)
        everyone = gather(torch.stack([shard.double(), scorer(x[shard])[:, 0].double(),
                                       labels[shard]], 1))
    index, scores, their_labels = everyone.T
    def replay(reverse):  # one process: every test sample, in one batch
        order = torch.arange(size).flip(0) if reverse else torch.arange(size)
        return [auroc(scorer(x[order])[:, 0].double(), labels[order])]  # (no gradient: a count)
    note = f"{len(index)} outputs for {size} test samples ({len(index) - len(index.unique())} " \
           f"counted twice); AUROC "
    advice = ("DistributedSampler's padding counts samples twice: gather unpadded shares of "
              "different lengths (lengths, pad, all_gather, trim): every sample once")
    found = run.is_main and verdict("outputs", [auroc(scores, their_labels)], replay, note, advice)
    once = len(index) == size == len(index.unique())  # (the indices are of range(size))
    return found or ("" if once else f"outputs: {note}: {advice}")


def main():
    args, run, proof = setup()
    micros = " then ".join(map(str, args.micro_batches))
    common.log(run, f"12_what_to_reduce.py: world_size={run.world_size} "
                    f"{'bug=' + args.bug if args.bug else 'all fixes'}, {PER_RANK} rows per rank "
                    f"and step in {micros} micro-batch(es), torch {torch.__version__}")
    names, part = [args.bug] if args.bug else PARTS, dict(tokens=tokens_part, gather=gather_part,
                                                          uneven=uneven_part)
    found = [part[n](args, run, proof, micro) for micro in args.micro_batches for n in names
             if n != "outputs"] + [outputs_part(args, run, proof) for n in names if n == "outputs"]
    wrong = [diagnosis for diagnosis in found if diagnosis]
    if not run.is_main:
        return
    if args.bug:  # the measurement decides, not --bug
        print(f"diagnosis: {wrong[0]}" if wrong else f"diagnosis: none measured: --bug "
              f"{args.bug} is planted, yet {run.world_size} ranks equal one process", flush=True)
        sys.exit(EXIT_MISTAKE if wrong else 0)
    if wrong:
        raise common.UserError(f"a fix did not hold: {'; '.join(wrong)}")
    print(f"all four hold: {run.world_size} ranks equal one process with {micros} "
          f"micro-batch(es): tokens, gather, uneven (every sample trained once), outputs (every "
          f"test sample once)", flush=True)


if __name__ == "__main__":
    common.run_main(main)
