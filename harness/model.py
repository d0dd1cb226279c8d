"""The model: the classic MNIST CNN of pytorch/examples (about 99 % test accuracy on MNIST).

Step 00 first needs it; every step trains the same network, so results compare across steps.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    """Two convolutions, dropout, two linear layers: 1.2 M parameters, 1.1 M of them in fc1.
    `width` multiplies fc1's hidden units (benchmarks use it: more gradients to communicate)."""

    def __init__(self, dropout: bool = True, width: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3)
        self.conv2 = nn.Conv2d(32, 64, 3)
        self.fc1 = nn.Linear(9216, 128 * width)
        self.fc2 = nn.Linear(128 * width, 10)
        self.dropout1 = nn.Dropout(0.25 if dropout else 0.0)
        self.dropout2 = nn.Dropout(0.5 if dropout else 0.0)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return self.fc2(x)  # logits; cross_entropy applies log-softmax


def build_model(args, seed: int) -> Net:
    """The model initialised from `seed` alone, not from the global RNG: the same seed gives
    the same weights on every rank, whatever ran before."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Net(dropout=args.dropout, width=getattr(args, "width", 1))
