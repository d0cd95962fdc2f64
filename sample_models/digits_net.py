"""The architecture of the sample checkpoints: a small CNN for 8x8 digit images.

Use it with `--arch sample_models/digits_net.py:digits_net`. Input: (N, 1, 8, 8)
float images scaled to [0, 1]; output: logits over 10 classes.
"""

from __future__ import annotations

from torch import nn


class DigitsNet(nn.Module):
    """conv-BN2d-ReLU x2, pool, linear-BN1d-ReLU-Dropout, linear: every BN kind a
    checkpoint audit meets (2-D maps and (N, C) features) plus a Dropout that must stay
    off while BN statistics are measured."""

    def __init__(self, num_classes: int = 10, width: int = 8, hidden: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * width * 16, hidden, bias=False),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x):
        return self.head(self.features(x))


def digits_net(num_classes: int = 10, width: int = 8, hidden: int = 32) -> DigitsNet:
    return DigitsNet(num_classes=num_classes, width=width, hidden=hidden)
