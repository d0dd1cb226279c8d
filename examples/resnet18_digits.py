"""A worked port: torchvision's resnet18 (BatchNorm), trained with train_template.py's loop.

The template's YOURS places, written for this model: the data (the tutorial's synthetic digits,
upsampled to 3x32x32: no download), the model, SGD with momentum, and flags of its own
(--bn, --train-samples, --test-samples). The loss and evaluation sums are the template's.

    torchrun --standalone --nproc-per-node 2 examples/resnet18_digits.py --check
    torchrun --standalone --nproc-per-node 2 examples/resnet18_digits.py --check --bn plain

--bn sync (the default) normalises over the global batch: torch's SyncBatchNorm on GPUs; on the
CPU, where torch's refuses CPU inputs, step 11's convert_batchnorm(). --bn plain normalises each
rank's share alone: --check fails, and its diagnosis names BatchNorm. (Either way the template
evaluates with rank 0's running statistics, broadcast first, as the checkpoint keeps them.)
"""

import math
import runpy
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.data import TensorDataset

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # where train_template.py is
import train_template as template  # noqa: E402

# The tutorial's offline digits: 28x28 uint8, drawn like handwriting (a torch-only file)
synthetic_digits = runpy.run_path(str(REPO / "harness/synthetic_digits.py"))["synthetic_digits"]
# Step 11's BatchNorm for the CPU, for every BatchNorm in a model (convert_sync_batchnorm's twin)
convert_batchnorm = runpy.run_path(str(REPO / "11_your_model.py"))["convert_batchnorm"]


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


if __name__ == "__main__":
    for name in ("add_flags", "build_datasets", "build_model", "build_optimizer"):
        setattr(template, name, globals()[name])  # this model's, in the template's places
    template.run()
