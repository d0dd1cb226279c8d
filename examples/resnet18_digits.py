"""A worked port: torchvision's resnet18 (BatchNorm), trained with train_template.py's loop.

The template's YOURS places, written for this model: the data (ten classes of 3x32x32 images
drawn here: no download), the model, SGD with momentum, and flags of its own (--bn,
--train-samples, --test-samples). The loss and evaluation sums are the template's. It needs
only train_template.py beside it: copy the two files out together.

    torchrun --standalone --nproc-per-node 2 examples/resnet18_digits.py --check
    torchrun --standalone --nproc-per-node 2 examples/resnet18_digits.py --check --bn plain
    torchrun --standalone --nproc-per-node 3 examples/resnet18_digits.py --check --batch-size 48

--bn sync (the default) normalises over the global batch: torch's SyncBatchNorm on GPUs; on the
CPU, where torch's refuses CPU inputs, convert_batchnorm() below (step 11's layer). --bn plain
normalises each rank's share alone: --check fails, and its diagnosis names BatchNorm.
"""

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from torch.utils.data import TensorDataset

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repository's, if none beside
import train_template as template  # noqa: E402


def at_most_100_000(text):  # drawn in memory: 12 KiB each (a huge count asked for terabytes)
    if template.positive(text) > 100_000:
        raise argparse.ArgumentTypeError(f"{text!r} is more than 100000 samples")
    return int(text)


def add_flags(parser):
    parser.add_argument("--bn", choices=["sync", "plain"], default="sync",
                        help="BatchNorm over the global batch (sync) or each rank's share")
    parser.add_argument("--train-samples", type=at_most_100_000, default=2048)
    parser.add_argument("--test-samples", type=at_most_100_000, default=512)
    parser.set_defaults(batch_size=64, lr=0.05, epochs=2, checkpoint_every=8)  # this model's


def build_datasets(args):  # each class a fixed pattern, each sample it plus noise: learnable
    g = torch.Generator().manual_seed(0)  # the same on every rank and run
    n = args.train_samples
    labels = torch.randint(10, (n + args.test_samples,), generator=g)
    patterns = torch.randn(10, 3, 32, 32, generator=g)
    noise = 2 * torch.randn(len(labels), 3, 32, 32, generator=g)
    images = (patterns[labels] + noise) / 5 ** 0.5  # normalised, as images are: mean 0, std 1
    return TensorDataset(images[:n], labels[:n]), TensorDataset(images[n:], labels[n:])


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


class AllReduceWithGradient(torch.autograd.Function):
    """A SUM over the ranks whose backward sums the gradients over the ranks too: each rank's
    input also gets the gradient that reaches it through the other ranks' losses."""
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


class AllReducedBatchNorm(nn.modules.batchnorm._BatchNorm):  # (private: every BatchNorm's base)
    """BatchNorm over the global batch on the CPU, as step 11 writes it: the global mean, then
    the squared deviations around it (two passes: as stable as BatchNorm2d)."""
    process_group = None  # None: every rank; the template's --check sets rank 0's group of one

    def _check_input_dim(self, x):
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x):
        if not self.training:
            return super().forward(x)  # the running statistics: nothing to synchronise
        per_channel = x.transpose(0, 1).flatten(1)  # channels x (samples * pixels)
        count = per_channel.new_tensor([per_channel.shape[1]])
        sums = AllReduceWithGradient.apply(torch.cat([per_channel.sum(1), count]),
                                           self.process_group)
        total, count = sums.split([self.num_features, 1])
        mean = total / count  # pass 1: the global mean
        var = AllReduceWithGradient.apply(((per_channel - mean[:, None]) ** 2).sum(1),
                                          self.process_group) / count  # pass 2
        if self.track_running_stats:  # what BatchNorm keeps: the unbiased variance
            with torch.no_grad():
                self.num_batches_tracked += 1
                momentum = 1 / self.num_batches_tracked.item() if self.momentum is None \
                    else self.momentum
                self.running_mean.lerp_(mean, momentum)
                self.running_var.lerp_(var * count / (count - 1), momentum)
        shape = (1, -1, *[1] * (x.dim() - 2))  # per channel
        x = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        return x * self.weight.view(shape) + self.bias.view(shape) if self.affine else x


def convert_batchnorm(module):
    """nn.SyncBatchNorm.convert_sync_batchnorm for the CPU: every BatchNorm becomes an
    AllReducedBatchNorm with its parameters and statistics (the same state dict)."""
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
