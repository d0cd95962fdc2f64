"""Models and faulty torch.compile backends for the parity tests (`--arch
tests/parity_models.py:resnet18`, `--against compile:FILE.py:fn`).

The faults are known truth: each backend changes exactly one batch-norm call of the graph
Dynamo hands it (the k-th, in graph order, which is execution order for these models) and
runs the graph as it then is (the `eager` backend: the FX graph's own code)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class BasicBlock(nn.Module):
    """torchvision's BasicBlock, its module names kept (conv1/bn1/conv2/bn2/downsample)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet18(nn.Module):
    """torchvision's resnet18 layout (20 BN layers under the same names), narrower."""

    def __init__(self, widths=(8, 16, 32, 64), classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        cin = widths[0]
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            self.add_module(f"layer{i + 1}", nn.Sequential(BasicBlock(cin, w, stride), BasicBlock(w, w, 1)))
            cin = w
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(x.mean((2, 3)))


class SharedBN(nn.Module):
    """One BN called twice per forward (after two convs), and one never called."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.spare = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv1(x)))
        x = torch.relu(self.bn(self.conv2(x)))
        return self.fc(x.mean((2, 3)))


def shared_bn() -> SharedBN:
    return SharedBN()


def resnet18() -> ResNet18:
    return ResNet18()


def trained_looking(model: nn.Module, seed: int = 1, shape: tuple[int, ...] = (3, 32, 32)) -> nn.Module:
    """`model` with BN statistics of its own activations (a cumulative average over a few
    train-mode passes on normal inputs), affine parameters away from 1 and 0, in eval mode."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    with torch.no_grad():
        for module in norms:
            module.reset_running_stats()
            module.momentum = None
        model.train()
        for _ in range(4):
            model(torch.randn(32, *shape, generator=g))
        for module in norms:
            module.momentum = 0.1
            module.weight.copy_(0.5 + torch.rand(module.num_features, generator=g))
            module.bias.copy_(torch.randn(module.num_features, generator=g) * 0.1)
    return model.eval()


def batch_norm_calls(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is F.batch_norm]


def eps_backend(k: int, eps: float = 1e-2):
    """A backend whose graph's k-th F.batch_norm call runs with `eps` instead of its own."""

    def backend(gm, example_inputs):
        node = batch_norm_calls(gm)[k]
        args = list(node.args)
        args[7] = eps  # F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
        node.args = tuple(args)
        gm.recompile()
        return gm.forward

    return backend


def scale_backend(k: int, factor: float = 1.01):
    """A backend that multiplies the k-th batch-norm call's output by `factor` (a 1% change
    of one layer's output): the call's users read the scaled value."""

    def backend(gm, example_inputs):
        node = batch_norm_calls(gm)[k]
        with gm.graph.inserting_after(node):
            scaled = gm.graph.call_function(torch.mul, (node, factor))
        node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
        gm.recompile()
        return gm.forward

    return backend


def failing_backend(gm, example_inputs):
    raise RuntimeError("this backend cannot compile anything")


# for --against compile:tests/parity_models.py:NAME
eps_of_the_fifth = eps_backend(4)
scale_of_the_fifth = scale_backend(4)
