"""Step 11 (side trip from 03): your own model under DDP: six mistakes, planted and fixed.

YourModel has BatchNorm, a head used every other step, activation checkpointing, clipping and a
checkpoint. Each --bug (sampler, unused, batchnorm, clip, checkpointing, save) plants one mistake;
--fix fixes all six. docs/your-model.md explains each.

Run it (2 or more processes; GPUs use torch's SyncBatchNorm, CPUs the one written here):
    torchrun --standalone --nproc-per-node 2 11_your_model.py --bug unused
    torchrun --standalone --nproc-per-node 2 11_your_model.py --fix

Look for: unused, checkpointing and save end in torch's own error; sampler, batchnorm and clip
train on, silently wrong. In the repository rank 0 also trains one process beside the ranks
(harness/step11_your_model.py): a --bug ends with "diagnosis: ...", --fix with each equality.
Then find the line marked "BUG" below.
"""

import contextlib
# The repository's checks and one-line errors (harness/__init__.py); a copied step runs without.
try: import harness  # noqa: E701, F401
except ModuleNotFoundError: pass  # noqa: E701
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as differentiable  # collectives autograd goes through
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, DistributedSampler

import common

# torch 2.15 warns on every use: "torch.distributed.nn.functional.all_reduce is deprecated, use
# torch.distributed._functional_collectives.all_reduce instead": a private module. This public
# one still works in 2.15 (it is what older torch on clusters has), so the warning is hushed.
warnings.filterwarnings("ignore", "torch.distributed.nn.functional.all_reduce is deprecated")
BUGS = ["sampler", "unused", "batchnorm", "clip", "checkpointing", "save"]
# Small and quick: every run ends in seconds, offline (common.py's synthetic digits; --data mnist
# for MNIST). 16 samples per rank by default, so that any world size divides the global batch;
# micro-batches of 8, so that there are two.
DEFAULTS = dict(data="synthetic", timeout=15, train_samples=1024, test_samples=64,
                batch_size=None, max_device_batch=8)


def parse_flags():
    parser = common.parser(__doc__, __file__)
    choice = parser.add_mutually_exclusive_group(required=True)
    choice.add_argument("--bug", choices=BUGS, help="plant one mistake (the other five stay fixed)")
    choice.add_argument("--fix", action="store_true", help="run all six fixes")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps to train "
                        "(default 4; --epochs is not used)")
    parser.add_argument("--max-norm", type=float, default=1.0,
                        help="clip the gradient norm to this (default 1.0)")
    parser.add_argument("--batchnorm-by-hand", action="store_true",
                        help="on GPUs too, the BatchNorm written here instead of torch's "
                             "SyncBatchNorm (to compare the two)")
    parser.set_defaults(**DEFAULTS)
    args = parser.parse_args()
    if args.batch_size is None and args.batch_per_rank is None:
        args.batch_per_rank = 16
    return args


def setup(args):
    """Join the process group as steps 05 on do (common.setup_distributed: step 04's setup);
    --timeout (15 s here) bounds every collective."""
    # INFO: DDP's errors name the parameters they are about, not only their indices. Read
    # when DDP is built; torch.distributed read the variable when it was imported.
    os.environ.setdefault("TORCH_DISTRIBUTED_DEBUG", "INFO")
    dist.set_debug_level_from_env()
    run = common.setup_distributed(args)
    if run.device.type == "cuda":  # the results compare at float32's rounding: no TF32
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = False
    return run


class YourModel(nn.Module):
    """What real models have and 03's CNN lacks: BatchNorm, a block under activation
    checkpointing (its activations recomputed in backward instead of kept), and an auxiliary
    head that only some steps use (deep supervision, a second task, a branch switched off)."""

    def __init__(self, reentrant: bool = False):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, stride=2)  # 28x28 -> 13x13
        self.bn1 = nn.BatchNorm2d(16)
        self.block = nn.Sequential(nn.Conv2d(16, 32, 3, stride=2), nn.ReLU())  # -> 6x6
        self.head = nn.Linear(32 * 6 * 6, 10)
        self.aux_head = nn.Linear(16, 10)  # a second opinion from the early features
        self.reentrant = reentrant

    def forward(self, x, with_aux: bool):
        x = F.relu(self.bn1(self.conv1(x)))
        aux = self.aux_head(x.mean(dim=(2, 3))) if with_aux else None
        # BUG checkpointing: use_reentrant=True runs the block's forward under no_grad, so
        # DDP's search for unused parameters (find_unused_parameters=True, the fix for
        # `unused`) does not see the block's weights, marks them ready at once, and backward's
        # recomputation marks them ready a second time. Fix: use_reentrant=False (torch's
        # recommendation; 2.15 warns when it is not passed), which DDP supports fully.
        x = checkpoint(self.block, x, use_reentrant=self.reentrant)
        return self.head(x.flatten(1)), aux


def loss_of(logits, aux, labels):
    """The task's loss, plus the auxiliary head's when this step uses it."""
    loss = F.cross_entropy(logits, labels)
    return loss if aux is None else loss + 0.3 * F.cross_entropy(aux, labels)


class AllReducedBatchNorm(nn.modules.batchnorm._BatchNorm):  # (private: every BatchNorm's base)
    """BatchNorm over the global batch, written out for the CPU: torch 2.15's SyncBatchNorm
    refuses CPU tensors in training ("SyncBatchNorm expected input tensor to be on GPU or XPU",
    nn/modules/batchnorm.py). One all-reduce of each channel's sum and count gives every rank the
    global mean; a second, of the squared deviations around it, the variance. (Two passes: in
    one, E[x^2] - mean^2 loses the variance to rounding where a channel's mean is large beside
    its spread.) The all-reduce is the differentiable one: its backward all-reduces the
    gradients, so each rank's input also gets the gradient that reaches it through the other
    ranks' losses, as in one process. (torch's SyncBatchNorm all-gathers each rank's mean,
    1/std and count instead: the same numbers.)"""
    process_group = None  # None: every rank (as SyncBatchNorm's; train_template --check sets it)

    def _check_input_dim(self, x):  # any BatchNorm: 1d, 2d or 3d
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x):
        if not self.training:
            return super().forward(x)  # the running statistics: nothing to synchronise
        per_channel = x.transpose(0, 1).flatten(1)  # channels x (samples * pixels)
        count = per_channel.new_tensor([per_channel.shape[1]])
        sums = differentiable.all_reduce(torch.cat([per_channel.sum(1), count]),
                                         group=self.process_group)
        total, count = sums.split([self.num_features, 1])  # (SUM, its gradients too)
        mean = total / count  # pass 1: the global mean
        squares = differentiable.all_reduce(((per_channel - mean[:, None]) ** 2).sum(1),
                                            group=self.process_group)
        var = squares / count  # pass 2: biased, as BatchNorm normalises
        if self.track_running_stats:  # what BatchNorm keeps: the unbiased variance
            with torch.no_grad():
                self.num_batches_tracked += 1
                momentum = 1 / self.num_batches_tracked.item() if self.momentum is None \
                    else self.momentum  # (None: a cumulative average, as BatchNorm's)
                self.running_mean.lerp_(mean, momentum)
                self.running_var.lerp_(var * count / (count - 1), momentum)
        shape = (1, -1, *[1] * (x.dim() - 2))  # per channel
        x = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        return x * self.weight.view(shape) + self.bias.view(shape) if self.affine else x


def convert_batchnorm(module):
    """nn.SyncBatchNorm.convert_sync_batchnorm for the CPU: every BatchNorm in `module`, of any
    kind, becomes an AllReducedBatchNorm with its parameters and statistics (the same state
    dict). The new layers are made on the CPU: move the model to its device after."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        synced = AllReducedBatchNorm(module.num_features, module.eps, module.momentum,
                                     module.affine, module.track_running_stats)
        synced.load_state_dict(module.state_dict())
        return synced
    for name, child in module.named_children():
        module.add_module(name, convert_batchnorm(child))
    return module


def synchronise_batchnorm(model, run, args):
    if args.bug == "batchnorm":
        # BUG batchnorm: each rank's BatchNorm normalises by its own micro-batch's mean and
        # variance, and updates its running statistics from them alone (DDP then broadcasts
        # rank 0's at every forward: forward_sync_buffers, on by default in torch 2.15).
        return model
    if run.device.type == "cuda" and not args.batchnorm_by_hand:
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)  # Fix on GPUs: torch's own
    return convert_batchnorm(model).to(run.device)  # Fix on the CPU: all-reduced by hand


def wrap(raw_model, run, args):
    device_ids = [run.device] if run.device.type == "cuda" else None
    if args.bug == "unused":
        # BUG unused: in the steps without the auxiliary loss, aux_head gets no gradient. DDP
        # waits for every parameter's gradient before it finishes a step's all-reduces; it
        # notices the missing ones when the next step's forward begins, and raises.
        return DDP(raw_model, device_ids=device_ids)
    # Fix: find_unused_parameters=True: after each forward DDP walks the autograd graph from
    # the outputs and marks the parameters it does not reach as ready (their gradients stay
    # None on every rank). When the SAME parameters are unused in EVERY step (a branch never
    # in the loss), static_graph=True is the cheaper fix: DDP learns the set in its first
    # step and does not walk the graph again. Here the set changes, and static_graph raises.
    return DDP(raw_model, device_ids=device_ids, find_unused_parameters=True)


def training_loader(train_set, run, args, plan):
    if args.bug == "sampler":
        # BUG sampler: a plain shuffling loader. Every rank seeded its generator alike (as
        # most scripts do), so every rank draws the same batches: N ranks take one rank's
        # step N times, and the epoch takes N times as long as it should.
        return common.make_loader(train_set, plan.per_rank, run, args, shuffle=True,
                                  drop_last=True)
    # Fix: DistributedSampler gives each rank a disjoint share (every N-th index of one
    # shuffle, the same on every rank), as in steps 02 and 03.
    sampler = DistributedSampler(train_set, num_replicas=run.world_size, rank=run.rank,
                                 shuffle=True, seed=args.seed)
    return common.make_loader(train_set, plan.per_rank, run, args, sampler=sampler,
                              drop_last=True)


def train_step(model, images, labels, optimizer, plan, with_aux, args) -> None:
    """One optimizer step over this rank's batch, in micro-batches that accumulate (as in 03)."""
    optimizer.zero_grad(set_to_none=True)
    micro_batches = list(zip(images.split(plan.micro_batch), labels.split(plan.micro_batch)))
    for i, (x, y) in enumerate(micro_batches):
        with model.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            logits, aux = model(x, with_aux=with_aux)
            (loss_of(logits, aux, y) * len(y) / len(labels)).backward()
        if args.bug == "clip":
            # BUG clip: clipping inside the loop clips this rank's partial gradient, not yet
            # averaged (no_sync), by this rank's norm: each rank scales differently.
            nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
    if args.bug != "clip":
        # Fix: clip once, after the last backward: DDP has averaged the gradients, so every
        # rank clips the same gradient by the same global norm, as one process would.
        nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
    optimizer.step()


def save_model(state: dict, path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    common.save_torch(path, state)


def save_and_reload(model, raw_model, test_images, run, args) -> float:
    """Save the trained weights, load them into a fresh plain model as an inference script
    would, and return how far its outputs are from the trained model's."""
    path = args.out_dir / "your_model.pt"
    if run.is_main:
        # BUG save: the wrapper's state dict: DDP keeps the model as `module`, so every key
        # starts with "module." (module.conv1.weight), which a plain YourModel does not know.
        # Fix: the plain model's own (model.module, as 03 saves it).
        save_model(model.state_dict() if args.bug == "save" else raw_model.state_dict(), path)
    dist.barrier()  # no rank reads the file before it is complete
    plain = YourModel().to(run.device)
    # weights_only=True: the file can hold tensors only, nothing that runs code when loaded
    plain.load_state_dict(torch.load(path, map_location=run.device, weights_only=True))
    plain.eval()
    raw_model.eval()
    with torch.no_grad():
        return (plain(test_images, with_aux=False)[0] -
                raw_model(test_images, with_aux=False)[0]).abs().max().item()


@torch.no_grad()
def show_result(raw_model, test_images, test_labels, reloaded, run, args) -> None:
    """The trained model on the test set; a silent mistake trains on and shows here only."""
    logits = raw_model.eval()(test_images, with_aux=False)[0]
    loss = F.cross_entropy(logits, test_labels).item()
    correct = (logits.argmax(dim=1) == test_labels).sum().item()
    common.log(run, f"after {args.steps} steps: test loss {loss:.4f}  test accuracy "
                    f"{100 * correct / len(test_labels):.2f}% ({correct}/{len(test_labels)}); "
                    f"your_model.pt reloaded into a plain YourModel: outputs {reloaded:g} apart")


def main():
    args = parse_flags()
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size < 2:  # checked before any work starts
        raise common.UserError("11 compares N ranks with one process: start 2 or more, e.g. "
                               "torchrun --standalone --nproc-per-node 2 11_your_model.py --fix")
    run = setup(args)
    train_set, test_set = common.load_datasets(args, run, download=run.is_main)
    plan = common.plan_batches(args, run.world_size, len(train_set))
    common.log(run, f"11_your_model.py: device={run.device} world_size={run.world_size} "
                    f"{'bug=' + args.bug if args.bug else 'all fixes'} batch="
                    f"{plan.global_batch} (= {run.world_size} x {plan.per_rank}, micro-batches "
                    f"of {plan.micro_batch}) steps={args.steps} max_norm={args.max_norm:g} "
                    f"TORCH_DISTRIBUTED_DEBUG={os.environ['TORCH_DISTRIBUTED_DEBUG']}")
    common.seed_everything(args.seed)  # the same seed on every rank, as most scripts do
    loader = training_loader(train_set, run, args, plan)
    if len(loader) < args.steps:
        raise common.UserError(f"--train-samples {len(train_set)} fill only {len(loader)} "
                               f"steps of {plan.global_batch}; give more, or fewer --steps")
    raw_model = YourModel(reentrant=args.bug == "checkpointing").to(run.device)
    raw_model = synchronise_batchnorm(raw_model, run, args)
    model = wrap(raw_model, run, args)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for step, (images, labels) in zip(range(args.steps), loader):
        model.train()
        with_aux = step % 2 == 1  # the auxiliary loss every other step
        train_step(model, images.to(run.device), labels.to(run.device), optimizer, plan,
                   with_aux, args)
    test_images, test_labels = (t.to(run.device) for t in next(iter(
        DataLoader(test_set, batch_size=len(test_set)))))
    reloaded = save_and_reload(model, raw_model, test_images, run, args)
    show_result(raw_model, test_images, test_labels, reloaded, run, args)


if __name__ == "__main__":
    common.run_main(main)
