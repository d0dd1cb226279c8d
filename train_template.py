"""Your model under DDP: the template to copy. One file, torch only; it runs alone.

Change the parts marked YOURS: datasets and collate, model, a batch's loss (a SUM and what it
counts: samples or tokens), evaluation sums, optimizer and schedule, your flags. The rest is
steps 02-07's loop: a sampler, seeding, exact evaluation, accumulation with no_sync, clipping,
bf16 or fp16, torch.compile, checkpoints with exact resume, a stop on SIGTERM or a NaN loss.
How to port, and what --check proves (exit 0: DDP computes what one process does): docs/porting.md

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 \\
        --max-restarts 3 train_template.py   # continues after a kill, from its checkpoint
    torchrun --standalone --nproc-per-node 2 train_template.py --check
"""

import argparse
import copy
import functools
import gc
import itertools
import math
import os
import signal
import tempfile
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401 -- before the group: imported after it (torch.compile,
# torchvision), its functions' default group keeps the group alive past destroy_process_group
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset
from torch.utils.data import default_collate

NO_SCALER = torch.amp.GradScaler("cuda", enabled=False)  # float32 and bf16 need none
VOTE_EVERY = 4  # steps between the ranks' votes on a stop signal (and at each epoch's end)

def build_datasets(args):  # YOURS: (train, test), map-style datasets of (input, target)
    g = torch.Generator().manual_seed(1234)  # the same synthetic data on every rank and run
    x, teacher = torch.randn(5120, 32, generator=g), torch.randn(32, 8, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(5120, 8, generator=g)).argmax(1)
    return TensorDataset(x[:4096], y[:4096]), TensorDataset(x[4096:], y[4096:])

def collate(samples):  # YOURS: samples -> one batch, a tuple of tensors (pad variable lengths)
    return default_collate(samples)

def build_model(args):  # YOURS (BatchNorm: examples/resnet18_digits.py's convert_batchnorm)
    return nn.Sequential(nn.Linear(32, 128), nn.LayerNorm(128), nn.GELU(), nn.Dropout(0.1),
                         nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 8))

def batch_loss(model, batch):  # YOURS: (the loss SUMMED over what it averages, how many)
    inputs, targets = batch  # a token loss: reduction="sum", count (targets != -100).sum()
    return F.cross_entropy(model(inputs), targets, reduction="sum"), len(targets)

def eval_sums(model, batch):  # YOURS: sums over a batch, added up over ranks: [loss, correct, n]
    inputs, targets = batch
    logits = model(inputs).float()
    return torch.stack([F.cross_entropy(logits, targets, reduction="sum"),
                        (logits.argmax(1) == targets).sum(), targets.new_tensor(len(targets))])

def build_optimizer(model, args, total_steps):  # YOURS: the optimizer and its schedule
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, total_steps // 20)  # a linear warm-up, then a cosine decay to 0
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(
        1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / total_steps)))

def add_flags(parser):  # YOURS: your own flags, of plain types (a restart checks them all)
    pass

class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, from rank 0 alone (every rank exits 2)
        if int(os.environ.get("RANK", 0)) == 0:  # (argparse's own prints its usage first)
            self.exit(2, f"{self.prog}: error: {message}\n")
        raise SystemExit(2)

def positive(text):  # a flag's type (yours too): a whole number, at least 1
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)

def parse_flags():
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=positive, default=3)
    p.add_argument("--batch-size", type=positive, default=96, help="GLOBAL: all ranks together")
    p.add_argument("--accumulation", type=positive, default=1, help="micro-batches per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-norm", type=float, default=1.0, help="clip gradients (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="runs/template")
    p.add_argument("--checkpoint-every", type=positive, default=20, metavar="STEPS")
    p.add_argument("--compile", action="store_true", help="DDP(torch.compile(model))")
    p.add_argument("--amp", action="store_true", help="bf16 (fp16 on GPUs without bf16)")
    p.add_argument("--find-unused-parameters", action="store_true",
                   help="for a branch that some steps or ranks do not use (DDP's switch)")
    p.add_argument("--check", action="store_true", help="compare with one process, then exit")
    p.add_argument("--check-steps", type=positive, default=3)
    add_flags(p)  # after the template's: its set_defaults() can change theirs
    args, world = p.parse_args(), int(os.environ.get("WORLD_SIZE", 1))
    if not (0 < args.lr < 1e9 and 0 <= args.max_norm < 1e9):
        p.error("--lr must be positive, --max-norm at least 0 (and both finite)")
    if args.batch_size % world or args.batch_size // world < args.accumulation:
        p.error(f"--batch-size {args.batch_size} does not divide into {world} rank(s) of at "
                f"least {args.accumulation} sample(s) (--accumulation)")
    if (int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0))  # pytorch/pytorch#135712
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        p.error("torchrun --max-restarts needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 where it "
                "starts, or a restarted group reads the dead group's addresses in its store")
    return args

def setup():
    """Join the process group (step 02): torchrun tells each process who it is."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # plain python: a world of one
    os.environ.setdefault("MASTER_PORT", "0")
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=int(os.environ.get("RANK", 0)),
                            world_size=int(os.environ.get("WORLD_SIZE", 1)))
    return device, dist.get_rank(), dist.get_world_size()

def autocast(device, args):  # --amp: bf16 (the CPU too), fp16 on GPUs without native bf16
    fp16 = args.amp and device.type == "cuda" and not torch.cuda.is_bf16_supported(False)
    return (torch.autocast(device.type, torch.float16 if fp16 else torch.bfloat16,
                           enabled=args.amp), torch.amp.GradScaler("cuda", enabled=fp16))

# The group a collective in batch_loss must use (a gather for a contrastive loss: examples/
loss_group = None  # contrastive.py): every rank (None); in --check's replay, rank 0 alone

class ResumableSampler(DistributedSampler):
    """The DistributedSampler, able to start mid-epoch: it skips what a checkpoint covers."""
    skip = 0

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self):
        return super().__len__() - self.skip

def split(samples, parts):  # a step's samples, in `parts` micro-batches as even as can be
    return [samples[i * len(samples) // parts:(i + 1) * len(samples) // parts]
            for i in range(parts)]

def micro_batches(samples, parts, keep=False):  # the loader's collate_fn (--check keeps samples)
    batches = [collate(part) for part in split(samples, parts)]
    return (batches, samples) if keep else batches

def to(batch, device):
    return [t.to(device) for t in batch]

def train_step(model, batches, optimizer, scheduler, scaler, amp, max_norm):
    """One optimizer step over micro-batches; returns [loss sum, count] over every rank."""
    optimizer.zero_grad(set_to_none=True)  # (not after the step: --check reads the gradients)
    totals = torch.zeros(2, dtype=torch.float64, device=next(model.parameters()).device)
    for i, batch in enumerate(batches):
        with model.no_sync() if i < len(batches) - 1 and isinstance(model, DDP) else nullcontext():
            with amp:  # DDP all-reduces in the last backward only (no_sync before it)
                loss, count = batch_loss(model, batch)
            scaler.scale(loss).backward()  # (a disabled scaler: loss.backward())
        totals += torch.stack([loss.detach().double(), torch.as_tensor(count).to(totals)])
    if isinstance(model, DDP):  # the ranks' shares: DDP averaged the gradients of the sums
        if not model.find_unused_parameters:  # else the other ranks wait for them forever
            unused = [n for n, p in model.module.named_parameters()
                      if p.requires_grad and p.grad is None]
            if unused:
                print(f"diagnosis: rank {dist.get_rank()}: no gradient for {', '.join(unused)}"
                      f" (a branch this rank did not use): --find-unused-parameters", flush=True)
                os._exit(3)  # (its peers fail at once, instead of waiting on this rank)
        dist.all_reduce(totals)  # (DDP averaged the gradients: times world size)
    scaler.unscale_(optimizer)  # clip the true gradients, not fp16's scaled ones
    scale = (dist.get_world_size() if isinstance(model, DDP) else 1) / totals[1].clamp(min=1)
    for p in model.parameters():  # the mean over every rank's samples (or tokens): (a tensor,
        if p.grad is not None:  # not .item(): no wait for the GPU)
            p.grad.mul_(scale)
    # after the last backward: the averaged gradients, the same on every rank (0: no clipping)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or math.inf)
    if not torch.isfinite(totals[0] if scaler.is_enabled() else totals[0] + norm):  # (fp16:
        loss, norm = totals[0].item(), norm.item()  # the scaler skips an inf norm's step)
        raise FloatingPointError(f"the loss is {loss}" if not math.isfinite(loss) else
                                 f"the gradients' norm is {norm}")  # (before the update)
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    return totals

@torch.no_grad()
def evaluate(raw_model, loader, device, amp):
    """Exact: each rank sums over its own shard, then the sums are added up."""
    for buffer in raw_model.buffers():  # rank 0's BatchNorm statistics (else they differ)
        dist.broadcast(buffer, src=0)
    raw_model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for batch in loader:
        with amp:
            sums += eval_sums(raw_model, to(batch, device)).double()
    raw_model.train()
    dist.all_reduce(sums)
    return sums[0].item() / sums[2].item(), sums[1].item() / sums[2].item()

def log(message):
    if dist.get_rank() == 0:  # every rank holds the same model: one speaks for all
        print(message, flush=True)

def replay(model, optimizer, scheduler, batches, max_norm):
    """The step one process takes on the global batch's micro-batches; what it left."""
    totals = train_step(model, batches, optimizer, scheduler, NO_SCALER, nullcontext(), max_norm)
    return left(model, totals)

def left(model, totals):  # what a step left (compared at once: no copies)
    return {"loss": {"loss": totals[0] / totals[1]}, "buffers": dict(model.named_buffers()),
            "gradients": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
            "weights": {n: p.detach() for n, p in model.named_parameters()}}

def check(model, raw_model, optimizer, scheduler, loader, device, args):
    """--check: rank 0 replays each global batch as one process (the reference: the i-th
    micro-batch of every rank's samples, collated as one), and again with the ranks' samples in
    reverse order (the control: as right, rounded otherwise). DDP passes where it differs from
    the reference at most 10x as much as the control does."""
    global loss_group
    for module in raw_model.modules():  # the ranks would draw other masks than one process
        if isinstance(module, (nn.Dropout, nn.MultiheadAttention)):
            setattr(module, "p" if isinstance(module, nn.Dropout) else "dropout", 0.0)
    rank, world, verdict, solo = dist.get_rank(), dist.get_world_size(), None, dist.new_group([0])
    twins = [copy.deepcopy(raw_model) for _ in range(2)]  # reference, control: DDP's weights
    for module in (m for twin in twins for m in twin.modules() if hasattr(m, "process_group")):
        module.process_group = solo  # SyncBatchNorm (or yours) replayed: over rank 0's batch
    optimizers = [build_optimizer(twin, args, args.epochs * len(loader)) for twin in twins]
    for step, (batches, samples) in zip(range(1, args.check_steps + 1), loader):
        totals = train_step(model, [to(b, device) for b in batches], optimizer, scheduler,
                            NO_SCALER, nullcontext(), args.max_norm)
        gathered = [None] * world
        dist.all_gather_object(gathered, samples)  # (the loader's, on the CPU)
        if rank != 0:
            continue  # (every rank runs every step: the collectives pair up)
        if world > 1 and all(same(g, gathered[0]) for g in gathered[1:]):
            verdict = verdict or "the ranks trained the same samples: use a DistributedSampler"
        loss_group = solo  # (the replay's gathers: rank 0's batch alone)
        ddp, ref, ctl = left(raw_model, totals), *(
            replay(twin, *opt, global_batches(gathered, order, args, device), args.max_norm)
            for twin, opt, order in zip(twins, optimizers, (range(world),
                                                             range(world - 1, -1, -1))))
        loss_group = None
        for kind in ("loss", "gradients", "buffers", "weights")[2 * (step > 1):]:
            if ref[kind]:
                verdict = verdict or compare(kind, step, ddp[kind], ref[kind], ctl[kind],
                                             raw_model)
    failed = torch.tensor(float(verdict is not None), device=device)
    dist.broadcast(failed, src=0)  # every rank exits alike
    log("diagnosis: " + (verdict or f"DDP on {world} ranks computes what one process "
                                    f"computes, within rounding, for {step} steps"))
    return int(failed.item())

def same(a, b):  # two ranks' samples, tensor for tensor
    return all(torch.equal(x, y) for s, t in zip(a, b) for x, y in zip(s, t))

def global_batches(gathered, ranks, args, device):  # micro-batch i: every rank's i-th, collated
    parts = [split(gathered[r], args.accumulation) for r in ranks]
    return [to(collate([s for p in parts for s in p[i]]), device)
            for i in range(args.accumulation)]

def compare(kind, step, ddp, reference, control, model):
    """One line: how far DDP is from the reference, beside the control's rounding."""
    (got, where), (floor, _) = (max(((a[k].double() - reference[k].double()).abs().max().item(),
                                     k) for k in a) for a in (ddp, control))
    ok = got <= 10 * floor + 1e-6  # (+1e-6: the control may round exactly as the reference)
    log(f"check step {step}, {kind}: off by {got:.3g} (rounding {floor:.3g})"
        f"{': ok' if ok else f' at {where}: DIFFERENT'}")
    per_rank_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) and not hasattr(
        m, "process_group") for m in model.modules())  # (SyncBatchNorm and ours have one)
    bn = "BatchNorm per rank: use convert_batchnorm (or SyncBatchNorm on GPUs)"
    hint = {"loss": bn if per_rank_bn else "batch_loss depends on how the ranks split the "
                    "batch: return the loss SUMMED and its count (tokens: a mean per rank?)",
            "buffers": bn if per_rank_bn else "a buffer updated from this rank's share alone",
            "gradients": "the loss agreed, its gradients not: batch_loss not SUMMED with its "
                         "count (tokens: a mean per rank?), a gather without gradient in it, "
                         "or clipping inside no_sync?",
            "weights": "an optimizer or schedule per rank?"}
    return None if ok else f"{kind} not as in one process at step {step} ({where}): {hint[kind]}"

def save(path, state):  # atomically, under a name no one can plant (mkstemp: O_EXCL, no link)
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".checkpoint.")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)  # a kill mid-write keeps the old one
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)

def main():
    args = parse_flags()
    stop = []  # a stop signal (SIGTERM: preemption, a time limit) is noted; the ranks agree
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))  # on a step
    device, rank, world = setup()
    amp, scaler = autocast(device, args)
    train_set, test_set = build_datasets(args)
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP checks them)
    raw_model = build_model(args).to(device)
    model = DDP(torch.compile(raw_model) if args.compile else raw_model,
                device_ids=[device] if device.type == "cuda" else None,
                find_unused_parameters=args.find_unused_parameters)
    per_rank = args.batch_size // world
    sampler = ResumableSampler(train_set, world, rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, per_rank, sampler=sampler, drop_last=True, collate_fn=
                        functools.partial(micro_batches, parts=args.accumulation, keep=args.check))
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), 256,
                             collate_fn=collate)
    steps = len(loader)  # per epoch
    if not steps:  # (the schedule would divide by 0): rank 0 says why, every rank exits 2
        log(f"error: --batch-size {args.batch_size} > {len(train_set)} training samples")
        return 2
    optimizer, scheduler = build_optimizer(model, args, args.epochs * steps)
    log(f"{world} rank(s) on {device}, {per_rank} samples each a step in {args.accumulation} "
        f"micro-batch(es), {steps} steps an epoch, amp "
        f"{'bf16' if args.amp and not scaler.is_enabled() else 'fp16' if args.amp else 'off'}")
    if args.check:
        return check(model, raw_model, optimizer, scheduler, loader, device, args)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "checkpoint.pt")
    kept = {"model": raw_model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}
    settings = {**vars(args), "out_dir": None, "check_steps": None}  # (movable; not training)
    restarted = any(int(os.environ.get(n, 0)) for n in (  # torchrun after a kill, a requeue
        "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))  # (SLURM): resume
    saved = torch.load(path, map_location="cpu", weights_only=True) if restarted and \
        os.path.isfile(path) else {}  # (weights_only: loading runs no code from the file)
    start, done, rng, sums = 0, 0, None, torch.zeros(2, dtype=torch.float64, device=device)
    if saved and saved.get("settings") != settings:  # another run's, in this --out-dir
        log(f"not resuming from {path}: another run's (flags {saved.get('settings')})")
    elif saved:
        for name, part in kept.items():
            part.load_state_dict(saved[name])
        start, done, sums = saved["epoch"], saved["step"], saved["sums"].to(device)
        if done and len(saved["rng"]) == world:  # mid-epoch: an epoch starts from its seed
            rng = saved["rng"][rank]
        log(f"resumed at step {done} of epoch {start + 1}")

    def checkpoint(epoch, step):  # every rank calls this: every rank's random state is kept
        states = [None] * world  # what dropout draws next, on each rank (exact resume)
        dist.all_gather_object(states, {"cpu": torch.get_rng_state(), **(
            {"cuda": torch.cuda.get_rng_state(device)} if device.type == "cuda" else {})})
        if not all(t.isfinite().all() for t in raw_model.state_dict().values()):
            raise FloatingPointError("the weights are not finite")  # (never saved)
        if rank == 0:  # every rank holds the same weights: one writer is enough
            save(path, {**{name: part.state_dict() for name, part in kept.items()}, "sums": sums,
                        "epoch": epoch, "step": step, "rng": states, "settings": settings})
        dist.barrier()  # no rank reads it before it is complete

    for epoch in range(start, args.epochs):
        torch.manual_seed(hash((args.seed, epoch, rank)))  # dropout: from these alone (07)
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        sampler.skip = done * per_rank  # the samples the checkpoint covers
        batches = iter(loader)  # (draws the same from the RNG as an uninterrupted run)
        if rng is not None:  # resumed mid-epoch: the random state the checkpoint kept
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng:
                torch.cuda.set_rng_state(rng["cuda"], device)
        sums, step, stopping = (sums if done else sums.zero_()), done, False  # (mid-epoch: saved)
        for micro in batches:
            sums += train_step(model, [to(b, device) for b in micro], optimizer, scheduler,
                               scaler, amp, args.max_norm)
            step += 1
            votes = torch.tensor(float(bool(stop)), device=device)
            voting = (epoch * steps + step) % VOTE_EVERY == 0 or step == steps  # (a vote
            if voting:  # waits for the GPU): any rank asked, all stop at one step
                dist.all_reduce(votes)
            stopping = voting and votes.item() > 0
            if step < steps and (stopping or step % args.checkpoint_every == 0):
                checkpoint(epoch, step)
            if stopping and step < steps:
                log(f"stopping at step {step} of epoch {epoch + 1}: checkpoint saved")
                return 75  # (sysexits' TEMPFAIL: stopped early, checkpointed; requeue me)
        done, rng = 0, None
        checkpoint(epoch + 1, 0)
        test_loss, accuracy = evaluate(raw_model, test_loader, device, amp)
        log(f"epoch {epoch + 1}: train loss {sums[0].item() / max(1, sums[1].item()):.4f}  "
            f"test loss {test_loss:.4f}  test accuracy {100 * accuracy:.2f}%")
        if stopping and epoch + 1 < args.epochs:
            log(f"stopping after epoch {epoch + 1}: checkpoint saved")
            return 75
    return 0

def run():
    try:
        code = main()
    except RuntimeError as err:  # a rank that left (its own line said why) breaks a collective
        if "by peer" not in str(err):  # (gloo: "Connection reset by peer", or "closed by")
            raise
        print(f"error: rank {dist.get_rank()}: another rank left during a collective", flush=True)
        os._exit(1)
    except FloatingPointError as err:  # on every rank alike: the loss and norm are all-reduced
        log(f"error: {err}: stopped, the last checkpoint kept as it was (a lower --lr?)")
        code = 1
    gc.collect()  # main's DDP model holds the group: gone first, then the group (else aborts)
    dist.destroy_process_group()
    raise SystemExit(code)

if __name__ == "__main__":
    run()
