"""A worked port: a contrastive loss (InfoNCE) over the global batch.

Each sample is two noisy views of one object; the encoder must match every view to its partner
among ALL the ranks' samples, not only its own rank's. batch_loss gathers the other ranks'
embeddings with a gather that carries gradient back to them (GatherWithGradient, below), over
the template's loss_group (--check replays it as one process). --gather plain uses
dist.all_gather, whose result carries no gradient: the loss is the same, its gradients are not,
and --check fails on them. Its test accuracy finds each view's partner among the views of the
same test batch, and a rank's batches come from its own share of the test set: on another number
of ranks the candidates differ, and so do the numbers (compare runs on one world size).

    torchrun --standalone --nproc-per-node 2 examples/contrastive.py --check
    torchrun --standalone --nproc-per-node 2 examples/contrastive.py --check --gather plain
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repository's, if none beside
import train_template as template  # noqa: E402

TEMPERATURE = 0.1


def add_flags(parser):
    parser.add_argument("--gather", choices=["grad", "plain"], default="grad",
                        help="grad: the gather with gradient; plain: dist.all_gather (wrong)")
    parser.set_defaults(batch_size=64, lr=1e-3, epochs=2)  # this model's


def build_datasets(args):  # 2560 objects, each seen twice with noise
    g = torch.Generator().manual_seed(0)
    objects = torch.randn(2560, 32, generator=g)
    a, b = (objects + 0.5 * torch.randn(2560, 32, generator=g) for _ in range(2))
    return TensorDataset(a[:2048], b[:2048]), TensorDataset(a[2048:], b[2048:])


def build_model(args):
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 64))


class GatherWithGradient(torch.autograd.Function):
    """Every rank's rows, in rank order. Backward: each rank's loss has a gradient for every
    row; they are summed over the ranks and each rank keeps its own rows' (all_reduce, then a
    slice). A sum, not a mean: DDP then averages, and the template divides by the count."""
    @staticmethod
    def forward(ctx, x):
        pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(template.loss_group))]
        dist.all_gather(pieces, x.contiguous(), group=template.loss_group)
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=template.loss_group)
        group = template.loss_group
        return grad.chunk(dist.get_world_size(group))[dist.get_rank(group)]


def gather_plain(x):  # the mistake: other ranks' rows come back as constants
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(template.loss_group))]
    dist.all_gather(pieces, x.contiguous(), group=template.loss_group)
    pieces[dist.get_rank(template.loss_group)] = x  # (its own rows keep their gradient)
    return torch.cat(pieces)


def batch_loss(model, batch):  # summed over this rank's samples, each against every rank's
    a, b = batch
    queries, keys = (F.normalize(model(x), dim=1) for x in (a, b))
    gather = gather_plain if template_args.gather == "plain" else GatherWithGradient.apply
    logits = queries @ gather(keys).T / TEMPERATURE
    first = dist.get_rank(template.loss_group) * len(a)  # this rank's partners in the gather
    partners = torch.arange(first, first + len(a), device=a.device)
    return F.cross_entropy(logits, partners, reduction="sum"), len(a)


def eval_sums(model, batch):  # within each test batch: [loss sum, partners found, samples]
    a, b = batch
    logits = F.normalize(model(a), dim=1) @ F.normalize(model(b), dim=1).T / TEMPERATURE
    partners = torch.arange(len(a), device=a.device)
    return torch.stack([F.cross_entropy(logits.float(), partners, reduction="sum"),
                        (logits.argmax(1) == partners).sum(), partners.new_tensor(len(a))])


def parse_flags():  # the template's, remembered: batch_loss reads --gather
    global template_args
    template_args = plain_parse_flags()
    return template_args


if __name__ == "__main__":
    plain_parse_flags = template.parse_flags
    for name in ("add_flags", "build_datasets", "build_model", "batch_loss", "eval_sums",
                 "parse_flags"):
        setattr(template, name, globals()[name])  # this model's, in the template's places
    template.run()
