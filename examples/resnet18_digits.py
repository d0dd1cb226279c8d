"""A worked port: torchvision's resnet18 (BatchNorm), trained with train_template.py's loop.

The template's YOURS places, written for this model: the data (the tutorial's synthetic digits,
upsampled to 3x32x32: no download), the model, SGD with momentum, and flags of its own
(--bn, --train-samples, --test-samples). The loss and evaluation sums are the template's.

    torchrun --standalone --nproc-per-node 2 examples/resnet18_digits.py --check
    torchrun --standalone --nproc-per-node 2 examples/resnet18_digits.py --check --bn plain

--bn sync (the default) normalises over the global batch: torch's SyncBatchNorm on GPUs; on the
CPU, where torch's refuses CPU inputs, convert_batchnorm() below. --bn plain normalises each
rank's share alone: --check fails, and its diagnosis names BatchNorm. (Either way the template
evaluates with rank 0's running statistics, broadcast first, as the checkpoint keeps them.)
"""

import math
import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.data import TensorDataset

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # where train_template.py is
import train_template as template  # noqa: E402

# The tutorial's offline digits: 28x28 uint8, drawn like handwriting (a torch-only file)
synthetic_digits = runpy.run_path(str(REPO / "harness/synthetic_digits.py"))["synthetic_digits"]


def add_flags(parser):
    parser.add_argument("--bn", choices=["sync", "plain"], default="sync",
                        help="BatchNorm over the global batch (sync) or each rank's share")
    parser.add_argument("--train-samples", type=int, default=2048)
    parser.add_argument("--test-samples", type=int, default=512)
    parser.set_defaults(batch_size=64, lr=0.05, epochs=2, checkpoint_every=8)  # this model's


def build_datasets(args):
    images, labels = synthetic_digits(args.train_samples + args.test_samples, seed=0)
    x = F.interpolate(images[:, None].float() / 255, size=32, mode="bilinear")  # 28 -> 32
    x = ((x - 0.1307) / 0.3081).repeat(1, 3, 1, 1)  # MNIST's normalisation; 3 channels (RGB)
    n = args.train_samples
    return TensorDataset(x[:n], labels[:n]), TensorDataset(x[n:], labels[n:])


def build_model(args):
    model = torchvision.models.resnet18(num_classes=10)
    if args.bn == "plain":
        return model  # each rank's BatchNorm: its own share of the batch (--check catches it)
    if torch.cuda.is_available():
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return convert_batchnorm(model)  # the CPU: torch's SyncBatchNorm refuses CPU inputs


def build_optimizer(model, args, total_steps):
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(  # a cosine decay to 0
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / total_steps)))


class AllReduce(torch.autograd.Function):
    """The sum over ranks, whose gradient is the sum over ranks too: every rank's loss reaches
    every rank's input through the global statistics."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, x = group, x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class AllReducedBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over the global batch, for the CPU (torch's SyncBatchNorm refuses CPU inputs,
    and DDP refuses SyncBatchNorm on the CPU). Two passes, as stable as nn.BatchNorm2d: the
    global mean first (an all-reduce of each channel's sum and the count), then the variance
    from the squared deviations around it (a second all-reduce). E[x^2] - mean^2 in one pass
    would lose the variance to rounding where a channel's mean is large beside its spread.
    Autograd goes through both all-reduces (AllReduce), so the gradients are one process's."""
    process_group = None  # None: every rank (--check replays over rank 0's group alone)

    def _check_input_dim(self, x):  # any BatchNorm: 1d, 2d or 3d
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x):
        if not (self.training and dist.is_initialized()):
            return super().forward(x)  # evaluation: the running statistics, nothing to share
        group = self.process_group or dist.group.WORLD
        dims, shape = [0, *range(2, x.dim())], (1, -1, *[1] * (x.dim() - 2))  # all but channels
        count = x.new_tensor([x.numel() / x.shape[1]])  # values per channel, on this rank
        sums = AllReduce.apply(torch.cat([x.sum(dims), count]), group)
        count, mean = sums[-1], sums[:-1] / sums[-1]  # pass 1: the global mean
        centred = x - mean.view(shape)
        var = AllReduce.apply((centred ** 2).sum(dims), group) / count  # pass 2: the variance
        if self.track_running_stats:  # as BatchNorm keeps them: the unbiased variance
            with torch.no_grad():
                self.num_batches_tracked += 1
                momentum = 1 / self.num_batches_tracked.item() if self.momentum is None \
                    else self.momentum  # (None: a cumulative average, as BatchNorm's)
                self.running_mean.lerp_(mean, momentum)
                self.running_var.lerp_(var * count / (count - 1), momentum)
        x = centred * torch.rsqrt(var + self.eps).view(shape)
        return x * self.weight.view(shape) + self.bias.view(shape) if self.affine else x


def convert_batchnorm(module):
    """nn.SyncBatchNorm.convert_sync_batchnorm for the CPU: every BatchNorm in `module` (of any
    kind) becomes an AllReducedBatchNorm with its parameters and statistics (same state dict)."""
    # (_BatchNorm, private: every BatchNorm class's base; convert_sync_batchnorm tests it too)
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        synced = AllReducedBatchNorm(module.num_features, module.eps, module.momentum,
                                     module.affine, module.track_running_stats)
        synced.load_state_dict(module.state_dict())
        return synced
    for name, child in module.named_children():
        module.add_module(name, convert_batchnorm(child))
    return module


if __name__ == "__main__":
    for name in ("add_flags", "build_datasets", "build_model", "build_optimizer"):
        setattr(template, name, globals()[name])  # this model's, in the template's places
    template.run()
