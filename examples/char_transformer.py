"""A worked port: a 2-layer character-level transformer, trained with train_template.py's loop.

The template's YOURS places, written for this model: the data (a text that ships with Python,
as bytes), the model, the loss and evaluation sums per character, AdamW, and one flag of its own
(--chars). Everything else (sampler, accumulation, clipping, checkpoints, --check) is the
template's, unchanged. In your own project, put these functions in place of the template's.

    torchrun --standalone --nproc-per-node 2 examples/char_transformer.py --check
    torchrun --standalone --nproc-per-node 2 examples/char_transformer.py --epochs 4

Look for: --check passes on 2 ranks, and on 3 with a batch they divide (--batch-size 48), though
after 3 AdamW steps the weights differ from one process by a few 1e-6: as much as the control's
rounding does (docs/porting.md).
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repository's, if none beside
import train_template as template  # noqa: E402

CONTEXT = 32  # characters the model sees at once


def at_least_a_window(text):  # --chars: one window of CONTEXT + 1 at least (unfold needs it)
    if template.positive(text) <= CONTEXT:
        raise argparse.ArgumentTypeError(f"{text!r} is fewer than {CONTEXT + 1} characters")
    return int(text)


def add_flags(parser):
    parser.add_argument("--chars", type=at_least_a_window, default=40_000,
                        help="characters of text to use")
    parser.set_defaults(batch_size=32, accumulation=2, lr=1e-3, epochs=2)  # this model's


def build_datasets(args):
    text = Path(argparse.__file__).read_bytes()[:args.chars]  # (argparse's source: any text)
    windows = torch.tensor(list(text)).unfold(0, CONTEXT + 1, CONTEXT)  # bytes: 256 symbols
    inputs, targets = windows[:, :-1], windows[:, 1:]  # each position predicts the next one
    split = len(windows) * 9 // 10
    return (TensorDataset(inputs[:split], targets[:split]),
            TensorDataset(inputs[split:], targets[split:]))


class CharTransformer(nn.Module):
    def __init__(self, width=64, layers=2, heads=4):
        super().__init__()
        self.embed, self.position = nn.Embedding(256, width), nn.Embedding(CONTEXT, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.1,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, 256)

    def forward(self, x):
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        h = self.embed(x) + self.position(torch.arange(x.shape[1], device=x.device))
        return self.head(self.blocks(h, mask=causal, is_causal=True))


def build_model(args):
    return CharTransformer()


def batch_loss(model, batch):  # summed over the batch's characters, and how many
    inputs, targets = batch
    return (F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), reduction="sum"),
            targets.numel())


def eval_sums(model, batch):  # per character: [loss sum, correct guesses, characters]
    inputs, targets = batch
    logits, targets = model(inputs).float().flatten(0, 1), targets.flatten()
    count = torch.tensor(len(targets), device=logits.device)  # (stack takes one device)
    return torch.stack([F.cross_entropy(logits, targets, reduction="sum"),
                        (logits.argmax(1) == targets).sum(), count])


def build_optimizer(model, args, total_steps):
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    warmup = max(1, total_steps // 10)  # a linear warm-up, then constant
    return optimizer, torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup))


if __name__ == "__main__":
    for name in ("add_flags", "build_datasets", "build_model", "batch_loss", "eval_sums",
                 "build_optimizer"):
        setattr(template, name, globals()[name])  # this model's, in the template's places
    template.run()
