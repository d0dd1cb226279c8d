"""A worked port: a GRU language model on lines of different lengths, padded per batch.

What it shows: a token loss. Each batch pads its lines to its longest (the template's `collate`
place), and the targets' padding is -100, which cross_entropy ignores. Ranks then hold different
numbers of real tokens, and a mean per rank weighs them wrongly: batch_loss returns the loss
SUMMED over real tokens and their count, and the template divides by the count over every rank
and micro-batch. --loss mean (the per-rank token mean, as a single process would write it)
fails --check, which names the count.

    torchrun --standalone --nproc-per-node 2 examples/padded_lm.py --check --accumulation 2
    torchrun --standalone --nproc-per-node 2 examples/padded_lm.py --check --loss mean
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repository's, if none beside
import train_template as template  # noqa: E402

IGNORE = -100  # cross_entropy's ignore_index: a padded target


def add_flags(parser):
    parser.add_argument("--loss", choices=["sum", "mean"], default="sum",
                        help="sum: over real tokens, with their count; mean: per rank (wrong)")
    parser.add_argument("--lines", type=template.positive, default=1600)
    parser.set_defaults(batch_size=32, lr=3e-3, epochs=2)  # this model's


def build_datasets(args):  # each line of a text that ships with Python, 8 to 80 bytes
    text = Path(argparse.__file__).read_bytes().splitlines()
    lines = [torch.tensor(list(line)) for line in text if 8 <= len(line) <= 80][:args.lines]
    samples = [(line[:-1], line[1:]) for line in lines]  # each byte predicts the next one
    split = len(samples) * 9 // 10
    return samples[:split], samples[split:]  # (a list is a map-style dataset)


def collate(samples):  # pad to the batch's longest line: inputs with 0, targets with IGNORE
    inputs, targets = zip(*samples)
    return (pad_sequence(inputs, batch_first=True),
            pad_sequence(targets, batch_first=True, padding_value=IGNORE))


class GRULanguageModel(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.embed, self.gru = nn.Embedding(256, width), nn.GRU(width, 2 * width, batch_first=True)
        self.head = nn.Linear(2 * width, 256)

    def forward(self, x):  # (left to right: padding at the end changes no real position)
        return self.head(self.gru(self.embed(x))[0])


def build_model(args):
    return GRULanguageModel()


def batch_loss(model, batch):
    inputs, targets = batch
    logits, targets = model(inputs).flatten(0, 1), targets.flatten()
    if template_args.loss == "mean":  # the mistake: the mean over THIS rank's tokens
        return F.cross_entropy(logits, targets, ignore_index=IGNORE) * len(inputs), len(inputs)
    return (F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum"),
            (targets != IGNORE).sum())


def eval_sums(model, batch):  # per real token: [loss sum, correct guesses, tokens]
    inputs, targets = batch
    logits, targets = model(inputs).float().flatten(0, 1), targets.flatten()
    real = targets != IGNORE
    return torch.stack([F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum"),
                        (logits.argmax(1) == targets)[real].sum(), real.sum()])


def parse_flags():  # the template's, remembered: batch_loss reads --loss
    global template_args
    template_args = plain_parse_flags()
    return template_args


if __name__ == "__main__":
    plain_parse_flags = template.parse_flags
    for name in ("add_flags", "build_datasets", "collate", "build_model", "batch_loss",
                 "eval_sums", "parse_flags"):
        setattr(template, name, globals()[name])  # this model's, in the template's places
    template.run()
