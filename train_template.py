"""Your model under DDP: the template to copy. One file, torch only; it runs alone.

Change the parts marked YOURS: datasets, model, a batch's loss and evaluation sums, optimizer and
schedule, your flags. The rest is steps 02-07's loop: a sampler, seeding, exact evaluation,
accumulation with no_sync, clipping, bf16 or fp16, torch.compile, checkpoints with exact resume.
How to port, and what --check proves (exit 0: DDP computes what one process does): docs/porting.md

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 \\
        --max-restarts 3 train_template.py   # continues after a kill, from its checkpoint
    torchrun --standalone --nproc-per-node 2 train_template.py --check
"""

import argparse
import copy
import gc
import itertools
import math
import os
import signal
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401 -- before the group: imported after it (torch.compile,
# torchvision), its functions' default group keeps the group alive past destroy_process_group
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

NO_SCALER = torch.amp.GradScaler("cuda", enabled=False)  # float32 and bf16 need none

def build_datasets(args):  # YOURS: (train, test), map-style datasets of (input, target)
    g = torch.Generator().manual_seed(1234)  # the same synthetic data on every rank and run
    x, teacher = torch.randn(5120, 32, generator=g), torch.randn(32, 8, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(5120, 8, generator=g)).argmax(1)
    return TensorDataset(x[:4096], y[:4096]), TensorDataset(x[4096:], y[4096:])

def build_model(args):  # YOURS (BatchNorm on GPUs: nn.SyncBatchNorm.convert_sync_batchnorm)
    return nn.Sequential(nn.Linear(32, 128), nn.LayerNorm(128), nn.GELU(), nn.Dropout(0.1),
                         nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 8))

def batch_loss(model, batch):  # YOURS: the MEAN loss over the batch's samples
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets)

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

def parse_flags():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=128, help="GLOBAL: all ranks together")
    p.add_argument("--accumulation", type=int, default=1, help="micro-batches per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-norm", type=float, default=1.0, help="clip gradients (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="runs/template")
    p.add_argument("--checkpoint-every", type=int, default=20, metavar="STEPS")
    p.add_argument("--compile", action="store_true", help="DDP(torch.compile(model))")
    p.add_argument("--amp", action="store_true", help="bf16, or fp16 on GPUs without bf16")
    p.add_argument("--check", action="store_true", help="compare with one process, then exit")
    p.add_argument("--check-steps", type=int, default=3)
    add_flags(p)  # after the template's: its set_defaults() can change theirs
    args, world = p.parse_args(), int(os.environ.get("WORLD_SIZE", 1))
    if min(args.epochs, args.batch_size, args.accumulation, args.checkpoint_every,
           args.check_steps) < 1 or not (0 < args.lr < 1e9 and 0 <= args.max_norm < 1e9):
        p.error("counts and --lr must be positive, --max-norm at least 0 (and finite)")
    if args.batch_size % (world * args.accumulation):
        p.error(f"--batch-size {args.batch_size} does not divide into {world} rank(s) x "
                f"{args.accumulation} micro-batch(es)")
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

def autocast(device, args):  # --amp: bf16 where the GPU computes it natively, else fp16
    amp = args.amp and device.type == "cuda"
    fp16 = amp and not torch.cuda.is_bf16_supported(False)  # (T4, V100)
    return (torch.autocast(device.type, torch.float16 if fp16 else torch.bfloat16, enabled=amp),
            torch.amp.GradScaler("cuda", enabled=fp16))  # else fp16 flushes small gradients

class ResumableSampler(DistributedSampler):
    """The DistributedSampler, able to start mid-epoch: it skips what a checkpoint covers."""
    skip = 0

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self):
        return super().__len__() - self.skip

def train_step(model, batch, optimizer, scheduler, scaler, amp, max_norm, parts):
    """One optimizer step in `parts` micro-batches; returns this rank's mean loss."""
    optimizer.zero_grad(set_to_none=True)  # (not after the step: --check reads the gradients)
    loss_sum = 0.0
    for i, micro in enumerate(zip(*(tensor.chunk(parts) for tensor in batch))):
        with model.no_sync() if i < parts - 1 and isinstance(model, DDP) else nullcontext():
            with amp:  # DDP all-reduces in the last backward only (no_sync before it)
                loss = batch_loss(model, micro) / parts
            scaler.scale(loss).backward()  # (a disabled scaler: loss.backward())
        loss_sum += loss.detach()
    scaler.unscale_(optimizer)  # clip the true gradients, not fp16's scaled ones
    if max_norm:  # after the last backward: the averaged gradients, the same on every rank
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    return loss_sum

@torch.no_grad()
def evaluate(raw_model, loader, device, amp):
    """Exact: each rank sums over its own shard, then the sums are added up."""
    for buffer in raw_model.buffers():  # rank 0's BatchNorm statistics (else they differ)
        dist.broadcast(buffer, src=0)
    raw_model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for batch in loader:
        with amp:
            sums += eval_sums(raw_model, [t.to(device) for t in batch]).double()
    raw_model.train()
    dist.all_reduce(sums)
    return sums[0].item() / sums[2].item(), sums[1].item() / sums[2].item()

def log(message):
    if dist.get_rank() == 0:  # every rank holds the same model: one speaks for all
        print(message, flush=True)

def replay(model, optimizer, scheduler, gathered, args, ranks):
    """The step one process takes on the global batch (the i-th micro-batch of every rank, in
    the order `ranks`, in one forward: what SyncBatchNorm normalises over); what it left."""
    whole = [torch.stack([gathered[r][i].unflatten(0, (args.accumulation, -1)) for r in ranks],
                         dim=1).flatten(0, 2) for i in range(len(gathered[0]))]  # micro-major
    return left(model, train_step(model, whole, optimizer, scheduler, NO_SCALER, nullcontext(),
                                  args.max_norm, args.accumulation))

def left(model, loss):  # what a step left (compared at once: no copies)
    return {"loss": {"loss": loss.detach()}, "buffers": dict(model.named_buffers()),
            "gradients": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
            "weights": {n: p.detach() for n, p in model.named_parameters()}}

def check(model, raw_model, optimizer, scheduler, loader, device, args):
    """--check: rank 0 replays each global batch as one process (the reference), and again with
    the ranks' samples in reverse order (the control: as right, rounded otherwise). DDP passes
    where it differs from the reference at most 10x as much as the control does."""
    for module in raw_model.modules():  # the ranks would draw other masks than one process
        if isinstance(module, (nn.Dropout, nn.MultiheadAttention)):
            setattr(module, "p" if isinstance(module, nn.Dropout) else "dropout", 0.0)
    rank, world, verdict, solo = dist.get_rank(), dist.get_world_size(), None, dist.new_group([0])
    twins = [copy.deepcopy(raw_model) for _ in range(2)]  # reference, control: DDP's weights
    for module in (m for twin in twins for m in twin.modules() if hasattr(m, "process_group")):
        module.process_group = solo  # SyncBatchNorm (or yours) replayed: over rank 0's batch
    optimizers = [build_optimizer(twin, args, args.epochs * len(loader)) for twin in twins]
    for step, batch in zip(range(1, args.check_steps + 1), loader):
        loss = train_step(model, [t.to(device) for t in batch], optimizer, scheduler, NO_SCALER,
                          nullcontext(), args.max_norm, args.accumulation)
        dist.all_reduce(loss)  # the sum of the ranks' means
        gathered = [None] * world
        dist.all_gather_object(gathered, list(batch))  # (the loader's, on the CPU)
        if rank != 0:
            continue  # (every rank runs every step: the collectives pair up)
        if world > 1 and all(torch.equal(g[0], gathered[0][0]) for g in gathered[1:]):
            verdict = verdict or "the ranks trained the same samples: use a DistributedSampler"
        gathered = [[t.to(device) for t in g] for g in gathered]
        ddp, ref, ctl = left(raw_model, loss / world), *(
            replay(twin, *opt, gathered, args, order) for twin, opt, order in
            zip(twins, optimizers, (range(world), range(world - 1, -1, -1))))
        for kind in ("loss", "gradients", "buffers", "weights")[2 * (step > 1):]:
            if ref[kind]:
                verdict = verdict or compare(kind, step, ddp[kind], ref[kind], ctl[kind])
    failed = torch.tensor(float(verdict is not None), device=device)
    dist.broadcast(failed, src=0)  # every rank exits alike
    log("diagnosis: " + (verdict or f"DDP on {world} ranks computes what one process "
                                    f"computes, within rounding, for {step} steps"))
    return int(failed.item())

def compare(kind, step, ddp, reference, control):
    """One line: how far DDP is from the reference, beside the control's rounding."""
    (got, where), (floor, _) = (max(((a[k].double() - reference[k].double()).abs().max().item(),
                                     k) for k in a) for a in (ddp, control))
    ok = got <= 10 * floor + 1e-6  # (+1e-6: the control may round exactly as the reference)
    log(f"check step {step}, {kind}: off by {got:.3g} (rounding {floor:.3g})"
        f"{': ok' if ok else f' at {where}: DIFFERENT'}")
    hint = {"loss": "BatchNorm per rank?", "buffers": "BatchNorm per rank: use SyncBatchNorm",
            "gradients": "not averaged as one process would (clipping inside no_sync? a loss "
                         "not the batch mean?)", "weights": "an optimizer or schedule per rank?"}
    return None if ok else f"{kind} not as in one process at step {step} ({where}): {hint[kind]}"

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
                device_ids=[device] if device.type == "cuda" else None)
    per_rank = args.batch_size // world
    sampler = ResumableSampler(train_set, world, rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, per_rank, sampler=sampler, drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), 256)
    steps = len(loader)  # per epoch
    optimizer, scheduler = build_optimizer(model, args, args.epochs * steps)
    if args.check:
        return check(model, raw_model, optimizer, scheduler, loader, device, args)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "checkpoint.pt")
    kept = {"model": raw_model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}
    settings = {**vars(args), "out_dir": None, "check_steps": None}  # (movable; not training)
    restarted = any(int(os.environ.get(n, 0)) for n in (  # torchrun after a kill, a requeue
        "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))  # (SLURM): resume
    saved = torch.load(path, map_location="cpu", weights_only=True) if restarted and \
        os.path.exists(path) else {}  # (weights_only: loading runs no code from the file)
    start, done, rng = 0, 0, None
    if saved and saved.get("settings") != settings:  # another run's, in this --out-dir
        log(f"not resuming from {path}: another run's (flags {saved.get('settings')})")
    elif saved:
        for name, part in kept.items():
            part.load_state_dict(saved[name])
        start, done = saved["epoch"], saved["step"]
        rng = saved["rng"][rank] if len(saved["rng"]) == world else None
        log(f"resumed at step {done} of epoch {start + 1}")

    def save(epoch, step):  # every rank calls this: every rank's random state is kept
        states = [None] * world  # what dropout draws next, on each rank (exact resume)
        dist.all_gather_object(states, {"cpu": torch.get_rng_state(), **(
            {"cuda": torch.cuda.get_rng_state(device)} if device.type == "cuda" else {})})
        if rank == 0:  # every rank holds the same weights: one writer is enough
            torch.save({**{name: part.state_dict() for name, part in kept.items()},
                        "epoch": epoch, "step": step, "rng": states, "settings": settings},
                       f"{path}.tmp")
            os.replace(f"{path}.tmp", path)  # atomically: a kill mid-write keeps the old one
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
        loss_sum, step = torch.zeros((), dtype=torch.float64, device=device), done
        for batch in batches:
            loss_sum += train_step(model, [t.to(device) for t in batch], optimizer, scheduler,
                                   scaler, amp, args.max_norm, args.accumulation)
            step += 1
            votes = torch.tensor(float(bool(stop)), device=device)
            if step % 10 == 0:  # a vote waits for the GPU: every 10th step (SLURM waits 30 s)
                dist.all_reduce(votes)  # any rank asked: all stop, at the same step
            stopping = step % 10 == 0 and votes.item() > 0
            if stopping or (step % args.checkpoint_every == 0 and step < steps):
                save(epoch, step)
            if stopping:
                log(f"stopping at step {step} of epoch {epoch + 1}: checkpoint saved")
                return 75  # (sysexits' TEMPFAIL: stopped early, checkpointed; requeue me)
        dist.all_reduce(loss_sum)  # every rank's samples (of the steps since a resume)
        train_loss = loss_sum.item() / max(1, world * (step - done))
        done, rng = 0, None
        save(epoch + 1, 0)
        test_loss, accuracy = evaluate(raw_model, test_loader, device, amp)
        log(f"epoch {epoch + 1}: train loss {train_loss:.4f}  test loss {test_loss:.4f}  "
            f"test accuracy {100 * accuracy:.2f}%")
    return 0

def run():
    code = main()
    gc.collect()  # main's DDP model holds the group: gone first, then the group (else aborts)
    dist.destroy_process_group()
    raise SystemExit(code)

if __name__ == "__main__":
    run()
