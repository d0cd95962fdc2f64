"""bnaudit's performance targets, measured side by side in one run.

    python benchmarks/run.py            # full run (about 1 GiB of extra tensors, ~2.5 GB of disk)
    python benchmarks/run.py --quick    # smaller inputs, fewer repeats
    python benchmarks/run.py --only 2 --against ../main  # start-up beside another checkout
    python benchmarks/run.py --only 1,2 # some targets only (8: sharded checkpoint through its index;
                                        # 9: invariance against a plain loop;
                                        # 10: .onnx with external data, needs the onnx extra;
                                        # 11: torch.save files without torch, one and a folder of 50
                                        # 12: diff --data on a fixed-batch-2 ONNX export;
                                        # 13: inspect --format html of 500 BN layers x 2048 channels;
                                        # 14: parity against a plain eager+target loop
                                        # 15: parity's peak RSS, 1000 vs 100 samples)

Every input is built here, in a temporary folder deleted at the end: a ResNet-50-shaped
state dict (53 BN layers, 25.6 M parameters) with and without 1 GiB of other tensors,
written as .safetensors and as a torch.save zip (and a before/after pair of it for
`bnaudit diff`, target 7, and the +extra one in Hugging Face shards with its index, target
8, and as an ONNX graph with its tensors as external data, target 9); a small ResNet for 32x32 inputs; a tensor file and synthetic image folders for gap and recalibrate.

Each measurement is one fresh process: wall time from start to exit, peak RSS from
`os.wait4` (the ru_maxrss of that one child; DataLoader workers are its children, so
the largest of them counts if it is larger). The compared commands run interleaved
(A B A B ...) after one warm-up run each, and each ratio is of the medians. Children run
with bytecode caching on (PYTHONDONTWRITEBYTECODE removed, as for an installed package)
and with this checkout first on PYTHONPATH. Each target prints one line:
the measured ratio, the target, PASS/FAIL (SKIP with the reason when its command does
not exist yet); INFO lines give context and judge nothing.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
GiB = 1024**3
MiB = 1024**2


# ----------------------------------------------------------------------------- measuring


@dataclass(frozen=True)
class Run:
    wall: float  # seconds
    maxrss: int  # bytes
    code: int
    max_children: int  # most descendant processes seen at one time (0 unless watched)
    cpu: float  # user + system seconds of the process and the children it waited for
    main_cpu: float  # of the process alone, last seen before it exited (0 unless watched)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("NO_COLOR", "1")
    env.update(extra or {})
    return env


def _descendants(pid: int) -> set[int]:
    found: set[int] = set()
    todo = [pid]
    while todo:
        current = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{current}/task/{task}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except OSError:
                continue
            for kid in kids:
                if kid not in found:
                    found.add(kid)
                    todo.append(kid)
    return found


def _own_cpu(pid: int) -> float | None:
    """utime + stime of `pid` alone (not its children), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(
    cmd: Sequence[str], env: dict[str, str] | None = None, watch_children: bool = False, cwd: str | None = None
) -> Run:
    """Run `cmd` once in a fresh process: wall time, peak RSS, CPU time, exit code."""
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(
            list(cmd), stdout=subprocess.DEVNULL, stderr=err, env=env or child_env(), cwd=cwd or REPO
        )
        most, main_cpu = 0, 0.0
        if watch_children:
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                most = max(most, len(_descendants(proc.pid)))
                main_cpu = _own_cpu(proc.pid) or main_cpu
                time.sleep(0.05)
        else:
            _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = code = os.waitstatus_to_exitcode(status)
        if code not in (0, 1):  # 1: inspect found problems, which is fine here
            err.seek(0)
            tail = err.read().decode(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"command failed ({code}): {' '.join(cmd)}\n  " + "\n  ".join(tail))
    return Run(wall, usage.ru_maxrss * 1024, code, most, usage.ru_utime + usage.ru_stime, main_cpu)


def compare(
    commands: dict[str, Sequence[str]],
    repeats: int,
    env: dict[str, str] | None = None,
    watch_children: bool = False,
    before_each: Callable[[], None] | None = None,
    envs: dict[str, dict[str, str]] | None = None,
    cwds: dict[str, str] | None = None,
) -> dict[str, list[Run]]:
    """One warm-up run each, then `repeats` interleaved rounds (A B C A B C ...); `envs`
    and `cwds` give some commands their own environment and working directory."""
    runs: dict[str, list[Run]] = {name: [] for name in commands}
    for round_ in range(repeats + 1):
        for name, cmd in commands.items():
            if before_each:
                before_each()
            run = measure(cmd, (envs or {}).get(name, env), watch_children, (cwds or {}).get(name))
            if round_:
                runs[name].append(run)
    return runs


def median_wall(runs: list[Run]) -> float:
    return statistics.median(r.wall for r in runs)


def min_wall(runs: list[Run]) -> float:
    return min(r.wall for r in runs)


def median_rss(runs: list[Run]) -> float:
    return statistics.median(r.maxrss for r in runs)


RESULTS: list[str] = []


def line(target: str, what: str, ratio: float | None, limit: float | None, detail: str = "") -> None:
    if ratio is None:
        verdict = "INFO"
        text = f"{target:>2}  {what:<58} {'':>7}  {'':<13} {verdict:<4}  {detail}"
    else:
        verdict = "INFO" if limit is None else ("PASS" if ratio <= limit else "FAIL")
        goal = "" if limit is None else f"<= {limit:.2f}x"
        text = f"{target:>2}  {what:<58} {ratio:6.2f}x  {goal:<13} {verdict:<4}  {detail}"
    print(text, flush=True)
    RESULTS.append(text)


def skip(target: str, what: str, reason: str) -> None:
    text = f"{target:>2}  {what:<58} {'':>7}  {'':<13} SKIP  {reason}"
    print(text, flush=True)
    RESULTS.append(text)


def fmt_s(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def fmt_mb(size: float) -> str:
    return f"{size / MiB:.0f} MiB"


def command_exists(name: str) -> bool:
    proc = subprocess.run([PY, "-m", "bnaudit", name, "--help"], capture_output=True, env=child_env(), cwd=REPO)
    return proc.returncode == 0


@functools.cache
def recalibrate_guard_flags() -> tuple[str, ...]:
    """The benchmark's calibration data is synthetic, so it disagrees with the model's
    mature statistics at the first layer: recalibrate's input-mismatch guard would refuse
    (that check is part of the measured run; the refusal is not). Checkouts from before
    the guard lack the option."""
    proc = subprocess.run(
        [PY, "-m", "bnaudit", "recalibrate", "--help"], capture_output=True, text=True, env=child_env(), cwd=REPO
    )
    return ("--allow-input-mismatch",) if "--allow-input-mismatch" in proc.stdout else ()


# ----------------------------------------------------------------------------- inputs


def resnet50_state_dict() -> dict:
    """torchvision ResNet-50's state-dict names and shapes; BN stats look trained."""
    import torch

    g = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}

    def conv(name: str, out_c: int, in_c: int, k: int) -> None:
        state[f"{name}.weight"] = torch.randn(out_c, in_c, k, k, generator=g) * 0.05

    def bn(name: str, c: int) -> None:
        state[f"{name}.weight"] = 0.5 + torch.rand(c, generator=g)
        state[f"{name}.bias"] = torch.randn(c, generator=g) * 0.1
        state[f"{name}.running_mean"] = torch.randn(c, generator=g) * 0.2
        state[f"{name}.running_var"] = 0.5 + torch.rand(c, generator=g)
        state[f"{name}.num_batches_tracked"] = torch.tensor(100_000)

    conv("conv1", 64, 3, 7)
    bn("bn1", 64)
    in_c = 64
    for stage, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512)), start=1):
        for b in range(blocks):
            p = f"layer{stage}.{b}"
            conv(f"{p}.conv1", width, in_c, 1)
            bn(f"{p}.bn1", width)
            conv(f"{p}.conv2", width, width, 3)
            bn(f"{p}.bn2", width)
            conv(f"{p}.conv3", width * 4, width, 1)
            bn(f"{p}.bn3", width * 4)
            if b == 0:
                conv(f"{p}.downsample.0", width * 4, in_c, 1)
                bn(f"{p}.downsample.1", width * 4)
            in_c = width * 4
    state["fc.weight"] = torch.randn(1000, 2048, generator=g) * 0.01
    state["fc.bias"] = torch.zeros(1000)
    return state


def with_extra_tensors(state: dict, total_bytes: int) -> dict:
    """`state` plus `total_bytes` of float32 tensors that are not BN, placed after layer2
    so BN tensors lie on both sides of them in the file."""
    import torch

    chunk = 64 * MiB
    extra = {}
    for i in range(max(1, total_bytes // chunk)):
        extra[f"extra.tables.{i}.weight"] = torch.full((chunk // 4 // 1024, 1024), 0.001 * (i + 1))
    out, placed = {}, False
    for name, tensor in state.items():
        if not placed and name.startswith("layer3."):
            out.update(extra)
            placed = True
        out[name] = tensor
    return out


BENCH_MODEL = '''
"""A small ResNet for 32x32 inputs: 3 stages x 2 basic blocks, 15 BN layers."""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, in_c, out_c, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(in_c, out_c, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_c)
        self.conv2 = nn.Conv2d(out_c, out_c, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_c)
        self.down = None
        if stride != 1 or in_c != out_c:
            self.down = nn.Sequential(nn.Conv2d(in_c, out_c, 1, stride, bias=False), nn.BatchNorm2d(out_c))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


def net():
    layers = [nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
    in_c = 16
    for out_c, stride in ((16, 1), (16, 1), (32, 2), (32, 1), (64, 2), (64, 1)):
        layers.append(Block(in_c, out_c, stride))
        in_c = out_c
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_c, 10)]
    return nn.Sequential(*layers)


def wide_net():
    """net() with twice the channels (about 4x the compute): compute-heavy per sample."""
    layers = [nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU()]
    in_c = 32
    for out_c, stride in ((32, 1), (32, 1), (64, 2), (64, 1), (128, 2), (128, 1)):
        layers.append(Block(in_c, out_c, stride))
        in_c = out_c
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_c, 10)]
    return nn.Sequential(*layers)
'''

# The plain-PyTorch references bnaudit is compared with: same model, checkpoint, data
# file, batch size and (shuffled, seeded) batches.
REF_COMMON = """
import sys, torch
sys.path.insert(0, {folder!r})
from bench_model import net
from safetensors.torch import load_file
model = net()
model.load_state_dict(torch.load({ckpt!r}, map_location="cpu", weights_only=True))
data = load_file({data!r})
inputs, labels = data["inputs"], data["labels"]
order = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(0))
batches = [(inputs[i], labels[i]) for i in order.split({batch})]
"""
REF_UPDATE_BN = (
    REF_COMMON
    + """
from torch.optim.swa_utils import update_bn
update_bn((x for x, _ in batches), model)
torch.save(model.state_dict(), sys.argv[1])
"""
)
REF_EVAL = (
    REF_COMMON
    + """
model.eval()
correct = 0
with torch.no_grad():
    for x, y in batches:
        correct += int((model(x).argmax(1) == y).sum())
print(correct / len(inputs))
"""
)


def build_small_model(folder: str) -> str:
    with open(os.path.join(folder, "bench_model.py"), "w") as f:
        f.write(BENCH_MODEL)
    return _save_with_statistics(folder, "net", "small_resnet.pt")


def build_wide_model(folder: str) -> str:
    """bench_model.wide_net (bench_model.py written by build_small_model)."""
    return _save_with_statistics(folder, "wide_net", "wide_resnet.pt")


def _save_with_statistics(folder: str, builder: str, name: str) -> str:
    """bench_model.<builder>() with running statistics as a trained model might hold them."""
    import torch

    sys.path.insert(0, folder)
    import bench_model  # type: ignore[import-not-found]

    model = getattr(bench_model, builder)()
    g = torch.Generator().manual_seed(1)
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.copy_(torch.randn(module.num_features, generator=g) * 0.1)
            module.running_var.copy_(0.5 + torch.rand(module.num_features, generator=g))
            module.num_batches_tracked.fill_(1000)
    path = os.path.join(folder, name)
    torch.save(model.state_dict(), path)
    return path


def build_fixed_batch_onnx(folder: str, ckpt: str) -> str:
    """bench_model.net with `ckpt`'s weights exported with a fixed batch of 2 (the legacy
    exporter, no dynamic axes), as exports made from a traced batch of 2 are."""
    import contextlib
    import io
    import warnings

    import torch

    sys.path.insert(0, folder)
    import bench_model  # type: ignore[import-not-found]

    model = bench_model.net()
    model.load_state_dict(torch.load(ckpt, map_location="cpu", weights_only=True))
    path = os.path.join(folder, "fixed_batch_2.onnx")
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(model.eval(), (torch.zeros(2, 3, 32, 32),), path, dynamo=False, input_names=["x"])
    return path


def build_folded_onnx(folder: str, ckpt: str) -> str:
    """bench_model.net with `ckpt`'s weights exported as most deployments are: BN folded into the
    convs (the legacy exporter's constant folding), a dynamic batch dimension."""
    import contextlib
    import io
    import warnings

    import torch

    sys.path.insert(0, folder)
    import bench_model  # type: ignore[import-not-found]

    model = bench_model.net()
    model.load_state_dict(torch.load(ckpt, map_location="cpu", weights_only=True))
    path = os.path.join(folder, "folded.onnx")
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(model.eval(), (torch.zeros(2, 3, 32, 32),), path, dynamo=False, input_names=["x"],
                          dynamic_axes={"x": {0: "n"}})  # fmt: skip
    return path


def build_tensor_data(path: str, samples: int) -> str:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(2)
    save_file(
        {
            "inputs": torch.randn(samples, 3, 32, 32, generator=g),
            "labels": torch.randint(0, 10, (samples,), generator=g),
        },
        path,
    )
    return path


def build_image_folder(root: str, images: int, size: int = 256) -> str:
    """ImageFolder layout, 10 classes, `images` JPEGs of size x size (decoded and resized
    to 32 by the data pipeline)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(3)
    base = rng.integers(0, 256, size=(16, size, size, 3), dtype=np.uint8)
    for i in range(images):
        folder = os.path.join(root, f"class_{i % 10}")
        os.makedirs(folder, exist_ok=True)
        pixels = np.roll(base[i % 16], shift=i, axis=1) // 2 + (i % 10) * 12
        Image.fromarray(pixels.astype(np.uint8)).save(os.path.join(folder, f"{i:06d}.jpg"), quality=90)
    return root


def build(function: str, *args: object) -> object:
    """Run a builder in a child process, so this process stays small: a child's peak RSS
    starts from its parent's RSS at fork time (Linux keeps the high-water mark across
    fork and exec), and would otherwise include every input built here."""
    proc = subprocess.run(
        [PY, os.path.abspath(__file__), "--build", function, json.dumps(args)],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=REPO,
    )
    if proc.returncode:
        raise RuntimeError(f"building {function} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def build_resnet50_files(tmp: str, extra_bytes: int) -> dict:
    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    state = resnet50_state_dict()
    big = with_extra_tensors(state, extra_bytes)
    files = {
        "st_small": os.path.join(tmp, "resnet50.safetensors"),
        "st_big": os.path.join(tmp, "resnet50_plus_extra.safetensors"),
        "pt_small": os.path.join(tmp, "resnet50.pt"),
        "pt_big": os.path.join(tmp, "resnet50_plus_extra.pt"),
    }
    save_file(state, files["st_small"])
    save_file(big, files["st_big"])
    torch.save(state, files["pt_small"])
    torch.save(big, files["pt_big"])
    return {"files": files, "bn_layers": sum(1 for k in state if k.endswith(".running_mean"))}


def build_resnet50_pair(tmp: str, extra_bytes: int) -> dict:
    """A before/after pair of ResNet-50 state dicts for `bnaudit diff`: layer1's BN
    statistics moved under identical weights (frozen but updating), layer4 trained; each
    side also written with `extra_bytes` of other tensors."""
    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    before = resnet50_state_dict()
    after = {k: v.clone() for k, v in before.items()}
    for name, tensor in after.items():
        if name.startswith("layer1.") and name.endswith(("running_mean", "running_var")):
            tensor.mul_(1.05)
        elif name.startswith("layer1.") and name.endswith("num_batches_tracked"):
            tensor.add_(100)
        elif name.startswith("layer4."):
            tensor.add_(0.01 if tensor.is_floating_point() else 100)
    files = {}
    for label, state in (("a", before), ("b", after)):
        files[f"st_small_{label}"] = os.path.join(tmp, f"diff_{label}.safetensors")
        files[f"st_big_{label}"] = os.path.join(tmp, f"diff_{label}_plus_extra.safetensors")
        files[f"pt_small_{label}"] = os.path.join(tmp, f"diff_{label}.pt")
        files[f"pt_big_{label}"] = os.path.join(tmp, f"diff_{label}_plus_extra.pt")
        big = with_extra_tensors(state, extra_bytes)
        save_file(state, files[f"st_small_{label}"])
        save_file(big, files[f"st_big_{label}"])
        torch.save(state, files[f"pt_small_{label}"])
        torch.save(big, files[f"pt_big_{label}"])
        del big
    return files


def build_one_layer(path: str) -> str:
    import numpy as np
    from safetensors.numpy import save_file

    save_file(
        {
            "bn.weight": np.ones(8, np.float32),
            "bn.bias": np.zeros(8, np.float32),
            "bn.running_mean": np.zeros(8, np.float32) + 0.1,
            "bn.running_var": np.ones(8, np.float32) * 0.7,
            "bn.num_batches_tracked": np.array(1000, np.int64),
        },
        path,
    )
    return path


def build_many_layers(path: str, layers: int = 500, channels: int = 2048) -> str:
    """`layers` BN layers of `channels` each (float32, mature counters), one in fifty with three
    dead channels (running_var 1e-7: BN004): a large model whose few flagged layers a page
    expands channel by channel."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {}
    for i in range(layers):
        prefix = f"blocks.{i // 3}.bn{i % 3}"
        var = rng.lognormal(-1.0, 0.6, channels).astype(np.float32)
        if i % 50 == 7:
            var[rng.choice(channels, 3, replace=False)] = 1e-7
        tensors[f"{prefix}.weight"] = rng.normal(1.0, 0.1, channels).astype(np.float32)
        tensors[f"{prefix}.bias"] = rng.normal(0.0, 0.1, channels).astype(np.float32)
        tensors[f"{prefix}.running_mean"] = rng.normal(0.0, 0.3, channels).astype(np.float32)
        tensors[f"{prefix}.running_var"] = var
        tensors[f"{prefix}.num_batches_tracked"] = np.array(20000, np.int64)
    save_file(tensors, path)
    return path


def build_resnet50_shards(tmp: str, extra_bytes: int) -> dict:
    """The ResNet-50 state dict with and without `extra_bytes` of other tensors, unsharded
    and sharded the Hugging Face way (`model-0000k-of-0000N.safetensors` of at most ~1/4 of
    the total each, plus `model.safetensors.index.json`): BN layers land in several shards."""
    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    state = resnet50_state_dict()
    big = with_extra_tensors(state, extra_bytes)
    files = {"small": os.path.join(tmp, "resnet50.safetensors"), "big": os.path.join(tmp, "resnet50_big.safetensors")}
    save_file(state, files["small"])
    save_file(big, files["big"])
    folder = os.path.join(tmp, "sharded")
    os.makedirs(folder)
    limit = sum(t.numel() * t.element_size() for t in big.values()) // 4 + 1
    shards: list[dict] = [{}]
    for name, tensor in big.items():
        if shards[-1] and sum(t.numel() * t.element_size() for t in shards[-1].values()) + tensor.nbytes > limit:
            shards.append({})
        shards[-1][name] = tensor
    weight_map = {}
    for k, part in enumerate(shards):
        shard = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, os.path.join(folder, shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    index = {"metadata": {"total_size": sum(t.nbytes for t in big.values())}, "weight_map": weight_map}
    files["sharded"] = os.path.join(folder, "model.safetensors.index.json")
    with open(files["sharded"], "w") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return {"files": files, "shards": len(shards)}


def build_resnet50_onnx(tmp: str, extra_bytes: int) -> dict:
    """A ResNet-50-shaped ONNX graph (each conv a Conv node followed by its BatchNormalization
    node; the graph is read, never run) whose every tensor is external data in one
    `weights.bin` beside it, written twice: as is, and with `extra_bytes` of other
    initializers placed in the middle of weights.bin (after layer2's tensors, so BN tensors
    lie on both sides). The extra bytes are a hole in a sparse file: reading them would cost
    as much as any bytes, while writing them costs nothing. Needs the onnx package."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    state = {k: v.numpy() for k, v in resnet50_state_dict().items() if not k.endswith("num_batches_tracked")}
    files = {}
    for label, extra in (("small", 0), ("big", extra_bytes)):
        folder = os.path.join(tmp, f"onnx_{label}")
        os.makedirs(folder)
        data_path = os.path.join(folder, "weights.bin")
        inits, nodes, offset = [], [], 0
        chunk = 64 * MiB

        def external(name: str, dims: list[int], nbytes: int, at: int) -> TensorProto:
            tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=dims)
            tensor.data_location = TensorProto.EXTERNAL
            for key, value in (("location", "weights.bin"), ("offset", str(at)), ("length", str(nbytes))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
            return tensor

        with open(data_path, "wb") as f:
            placed = False
            for name, array in state.items():
                if extra and not placed and name.startswith("layer3."):
                    for i in range(max(1, extra // chunk)):
                        inits.append(external(f"extra.tables.{i}.weight", [chunk // 4 // 1024, 1024], chunk, offset))
                        offset += chunk
                    f.truncate(offset)  # a hole: sparse on every common file system
                    f.seek(offset)
                    placed = True
                raw = np.ascontiguousarray(array, dtype="<f4").tobytes()
                inits.append(external(name, list(array.shape), len(raw), offset))
                f.write(raw)
                offset += len(raw)
        previous = "input"
        for name in state:
            if name.endswith(".running_mean"):
                bn = name.removesuffix(".running_mean")
                conv = bn.replace("bn", "conv").replace("downsample.1", "downsample.0")
                nodes.append(helper.make_node("Conv", [previous, f"{conv}.weight"], [f"{conv}.out"], name=conv))
                nodes.append(
                    helper.make_node(
                        "BatchNormalization",
                        [f"{conv}.out", f"{bn}.weight", f"{bn}.bias", f"{bn}.running_mean", f"{bn}.running_var"],
                        [f"{bn}.out"],
                        name=bn,
                    )
                )
                previous = f"{bn}.out"
        graph = helper.make_graph(
            nodes,
            "resnet50",
            [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 224, 224])],
            [helper.make_tensor_value_info(previous, TensorProto.FLOAT, None)],
            inits,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="bnaudit-bench")
        files[label] = os.path.join(folder, "model.onnx")
        onnx.save(model, files[label])
    return {"files": files, "bn_layers": sum(1 for k in state if k.endswith(".running_mean"))}


def build_torch_save_files(tmp: str, copies: int) -> dict:
    """For target 11: the ResNet-50 state dict as a torch.save zip, and a folder of `copies`
    distinct torch.save checkpoints (ResNet-50's stem and layer1: 11 BN layers, ~1 MiB
    each, statistics scaled per file so that no two are alike)."""
    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    state = resnet50_state_dict()
    one = os.path.join(tmp, "resnet50_torchfree.pt")
    torch.save(state, one)
    part = {k: v for k, v in state.items() if k.startswith(("conv1.", "bn1.", "layer1."))}
    folder = os.path.join(tmp, "torch_save_folder")
    os.makedirs(folder)
    st_folder = os.path.join(tmp, "safetensors_folder")  # the same files as safetensors, for context
    os.makedirs(st_folder)
    for i in range(copies):
        scaled = {k: v * (1 + i / 1000) if v.is_floating_point() else v for k, v in part.items()}
        torch.save(scaled, os.path.join(folder, f"ckpt_{i:03d}.pt"))
        save_file({k: v.contiguous() for k, v in scaled.items()}, os.path.join(st_folder, f"ckpt_{i:03d}.safetensors"))
    return {
        "one": one,
        "folder": folder,
        "first": os.path.join(folder, "ckpt_000.pt"),
        "st_folder": st_folder,
        "st_first": os.path.join(st_folder, "ckpt_000.safetensors"),
    }


BUILDERS = {
    f.__name__: f
    for f in (
        build_resnet50_files,
        build_resnet50_onnx,
        build_resnet50_shards,
        build_resnet50_pair,
        build_one_layer,
        build_small_model,
        build_wide_model,
        build_tensor_data,
        build_image_folder,
        build_torch_save_files,
        build_fixed_batch_onnx,
        build_many_layers,
        build_folded_onnx,
    )
}


# ----------------------------------------------------------------------------- targets


def target_1_size_independence(tmp: str, extra_bytes: int, repeats: int) -> dict[str, str]:
    built = build("build_resnet50_files", tmp, extra_bytes)
    files, n_bn = built["files"], built["bn_layers"]
    size = {k: os.path.getsize(v) for k, v in files.items()}
    gib = extra_bytes / GiB
    line(
        "1",
        f"inputs: ResNet-50 state dict, {n_bn} BN layers",
        None,
        None,
        f"{fmt_mb(size['st_small'])}; +{gib:g} GiB of other tensors: {fmt_mb(size['st_big'])}",
    )

    def inspect(path: str) -> list[str]:
        return [PY, "-m", "bnaudit", "inspect", path, "--format", "json"]

    for kind, label, naive in (
        ("st", ".safetensors", "from safetensors.torch import load_file; import sys; load_file(sys.argv[1])"),
        ("pt", "torch.save zip", "import sys, torch; torch.load(sys.argv[1], weights_only=True)"),
    ):
        runs = compare(
            {
                "small": inspect(files[f"{kind}_small"]),
                "big": inspect(files[f"{kind}_big"]),
                "naive": [PY, "-c", naive, files[f"{kind}_big"]],
            },
            repeats,
        )
        t_small, t_big, t_naive = (median_wall(runs[k]) for k in ("small", "big", "naive"))
        m_small, m_big, m_naive = (median_rss(runs[k]) for k in ("small", "big", "naive"))
        line(
            "1",
            f"inspect {label}: +{gib:g} GiB vs without, wall time",
            t_big / t_small,
            1.3,
            f"{fmt_s(t_big)} vs {fmt_s(t_small)}",
        )
        line(
            "1",
            f"inspect {label}: +{gib:g} GiB vs without, peak RSS",
            m_big / m_small,
            1.3,
            f"{fmt_mb(m_big)} vs {fmt_mb(m_small)}",
        )
        line(
            "1",
            f"naive full load vs inspect ({label} +{gib:g} GiB)",
            None,
            None,
            f"time {t_naive / t_big:.2f}x ({fmt_s(t_naive)}), peak RSS {m_naive / m_big:.2f}x ({fmt_mb(m_naive)})",
        )
    return files


def target_7_diff_size_independence(tmp: str, extra_bytes: int, repeats: int) -> None:
    """`bnaudit diff` reads only BN tensors: a pair with +extra_bytes of other tensors on
    each side costs at most 1.3x the same pair without them."""
    if not command_exists("diff"):
        skip("7", "diff: +GiB vs without", "no diff command")
        return
    files = build("build_resnet50_pair", tmp, extra_bytes)
    gib = extra_bytes / GiB

    def diff(kind: str, size: str) -> list[str]:
        a, b = files[f"{kind}_{size}_a"], files[f"{kind}_{size}_b"]
        return [PY, "-m", "bnaudit", "diff", a, b, "--format", "json", "--isolated"]

    try:
        for kind, label in (("st", ".safetensors"), ("pt", "torch.save zip")):
            runs = compare({"small": diff(kind, "small"), "big": diff(kind, "big")}, repeats)
            t_small, t_big = median_wall(runs["small"]), median_wall(runs["big"])
            m_small, m_big = median_rss(runs["small"]), median_rss(runs["big"])
            line(
                "7",
                f"diff {label}: +{gib:g} GiB each side vs without, wall",
                t_big / t_small,
                1.3,
                f"{fmt_s(t_big)} vs {fmt_s(t_small)}",
            )
            line(
                "7",
                f"diff {label}: +{gib:g} GiB each side vs without, RSS",
                m_big / m_small,
                1.3,
                f"{fmt_mb(m_big)} vs {fmt_mb(m_small)}",
            )
    finally:
        for path in files.values():
            os.remove(path)


def target_8_sharded(tmp: str, extra_bytes: int, repeats: int) -> None:
    """Size independence through a shard index: the sharded +extra checkpoint costs what
    the unsharded one without the extra tensors costs (only BN tensors are read)."""
    built = build("build_resnet50_shards", tmp, extra_bytes)
    files, gib = built["files"], extra_bytes / GiB
    runs = compare(
        {name: [PY, "-m", "bnaudit", "inspect", path, "--format", "json"] for name, path in files.items()},
        repeats,
    )
    t = {k: median_wall(v) for k, v in runs.items()}
    m = {k: median_rss(v) for k, v in runs.items()}
    what = f"inspect {built['shards']} shards (+{gib:g} GiB) vs unsharded without"
    line("8", f"{what}, wall time", t["sharded"] / t["small"], 1.3, f"{fmt_s(t['sharded'])} vs {fmt_s(t['small'])}")
    line("8", f"{what}, peak RSS", m["sharded"] / m["small"], 1.3, f"{fmt_mb(m['sharded'])} vs {fmt_mb(m['small'])}")
    line(
        "8",
        f"inspect sharded vs unsharded, both +{gib:g} GiB",
        None,
        None,
        f"time {t['sharded'] / t['big']:.2f}x ({fmt_s(t['big'])} unsharded), "
        f"peak RSS {m['sharded'] / m['big']:.2f}x ({fmt_mb(m['big'])} unsharded)",
    )
    for path in files.values():
        shutil.rmtree(os.path.dirname(path)) if path.endswith(".index.json") else os.remove(path)


def target_10_onnx_external_data(tmp: str, extra_bytes: int, repeats: int) -> None:
    """Size independence for ONNX external data: inspect of a model whose weights.bin holds
    +extra_bytes of other initializers costs what the same model without them costs (only
    the BN tensors' byte ranges are read)."""
    try:
        import onnx  # noqa: F401
    except ImportError:
        skip(
            "10", "inspect .onnx with external data", 'the onnx package is not installed (pip install "bnaudit[onnx]")'
        )
        return
    built = build("build_resnet50_onnx", tmp, extra_bytes)
    files, gib = built["files"], extra_bytes / GiB
    runs = compare(
        {name: [PY, "-m", "bnaudit", "inspect", path, "--format", "json"] for name, path in files.items()}, repeats
    )
    t = {k: median_wall(v) for k, v in runs.items()}
    m = {k: median_rss(v) for k, v in runs.items()}
    what = f"inspect .onnx: +{gib:g} GiB external data vs without"
    line("10", f"{what}, wall time", t["big"] / t["small"], 1.3, f"{fmt_s(t['big'])} vs {fmt_s(t['small'])}")
    line("10", f"{what}, peak RSS", m["big"] / m["small"], 1.3, f"{fmt_mb(m['big'])} vs {fmt_mb(m['small'])}")
    for path in files.values():
        shutil.rmtree(os.path.dirname(path))


# The start-up budget (issue #33), as multiples of `python -c 'import typer, rich'`: what a
# person or a pre-commit hook feels. rules and a ResNet-50 safetensors file are shown beside
# them (no budget of their own; the ResNet-50 torch.save zip has one, target 11).
STARTUP_LIMITS = {"help": 1.3, "inspect_tiny": 2.2, "rules": None, "inspect_resnet": None}


def target_2_startup(
    tmp: str, st_resnet: str | None, pt_resnet: str | None, repeats: int, against: str | None = None
) -> None:
    """`--help` at most 1.3x and `inspect` of a one-layer safetensors file at most 2.2x
    `import typer, rich` (the ratio of the medians judges; the ratio of the minima, less
    swayed by other load on the machine, is shown beside it). `against`: another checkout
    (e.g. main before a change) run interleaved with this one, its ratios as INFO lines."""
    tiny = build("build_one_layer", os.path.join(tmp, "one_layer.safetensors"))
    bn = [PY, "-m", "bnaudit"]
    commands = {
        "base": [PY, "-c", "import typer, rich"],
        # what any typer CLI that prints through rich pays before doing anything
        "floor": [PY, "-c", "import typer, rich, rich.console"],
        "help": bn + ["--help"],
        "inspect_tiny": bn + ["inspect", tiny],
    }
    # What a CLI pays that prints the same bytes through rich after reading the same header:
    # the floor of this design (typer, rich's console, json), with none of bnaudit's own work.
    shown = os.path.join(tmp, "one_layer_output.txt")
    with open(shown, "w", encoding="utf-8") as fh:
        done = subprocess.run(bn + ["inspect", tiny], capture_output=True, text=True, env=child_env(), cwd=REPO)
        fh.write(done.stdout)
    commands["same_bytes"] = [PY, "-c", _SAME_BYTES, tiny, shown]
    if st_resnet:
        commands["inspect_resnet"] = bn + ["inspect", st_resnet]
    has_rules = command_exists("rules")
    if has_rules:
        commands["rules"] = bn + ["rules"]
    if pt_resnet:
        commands["inspect_pt"] = bn + ["inspect", pt_resnet]
    envs: dict[str, dict[str, str]] = {}
    cwds: dict[str, str] = {}
    if against:
        other = child_env()
        other["PYTHONPATH"] = os.path.abspath(against) + os.pathsep + other["PYTHONPATH"]
        for key in [k for k in STARTUP_LIMITS if k in commands]:
            commands[f"{key}@against"] = commands[key]
            envs[f"{key}@against"] = other
            # `python -m` looks in the working directory first
            cwds[f"{key}@against"] = os.path.abspath(against)
    runs = compare(commands, repeats, envs=envs, cwds=cwds)
    base, base_min = median_wall(runs["base"]), min_wall(runs["base"])
    line("2", "reference: python -c 'import typer, rich'", None, None, f"{fmt_s(base)} (min {fmt_s(base_min)})")
    floor = median_wall(runs["floor"])
    line("2", "floor of a CLI printing with rich: import typer, rich, rich.console", floor / base, None, fmt_s(floor))
    same = median_wall(runs["same_bytes"])
    what = "floor of inspect .safetensors: read its header, print the same bytes through rich"
    line("2", what, same / base, None, fmt_s(same))
    words = {
        "help": "bnaudit --help",
        "rules": "bnaudit rules",
        "inspect_tiny": "bnaudit inspect .safetensors (1 BN layer)",
        "inspect_resnet": "bnaudit inspect .safetensors (ResNet-50)",
    }

    def report(key: str, what: str, limit: float | None) -> None:
        t, t_min = median_wall(runs[key]), min_wall(runs[key])
        line("2", what, t / base, limit, f"{fmt_s(t)}; of the minima {t_min / base_min:.2f}x")

    for key in STARTUP_LIMITS:
        if key in commands:
            report(key, f"{words[key]} vs import typer, rich", STARTUP_LIMITS[key])
            if against:
                report(f"{key}@against", f"  the same, {os.path.basename(os.path.abspath(against))}", None)
        elif key == "rules":
            skip("2", "bnaudit rules vs import typer, rich", "no `bnaudit rules` command on this branch yet")
    if pt_resnet:
        t = median_wall(runs["inspect_pt"])
        line("2", "bnaudit inspect torch.save zip (ResNet-50; see target 11)", t / base, None, fmt_s(t))


# argv: a safetensors file and a text file: read the file's header as bnaudit does, then print
# the text through a rich Console (what target 2's "same bytes" floor runs).
_SAME_BYTES = (
    "import json, sys, typer, rich\n"
    "from rich.console import Console\nfrom rich.text import Text\n"
    "with open(sys.argv[1], 'rb') as fh:\n"
    "    header = json.loads(fh.read(int.from_bytes(fh.read(8), 'little')))\n"
    "with open(sys.argv[2], encoding='utf-8') as fh:\n"
    "    Console().print(Text(fh.read()), end='')"
)


# Runs the CLI as `python -m bnaudit ARGS`, then says whether torch was imported.
_TORCH_PROBE = (
    "import runpy, sys; sys.argv = ['bnaudit', *sys.argv[1:]]\n"
    "try:\n    runpy.run_module('bnaudit', run_name='__main__')\nexcept SystemExit:\n    pass\n"
    "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)"
)


def target_11_torch_save_without_torch(tmp: str, repeats: int, copies: int = 50) -> None:
    """torch.save files are read by bnaudit's own unpickler: inspect of a ResNet-50 torch.save
    zip costs at most 2.5x `import typer, rich` with torch never imported, and a folder of
    `copies` checkpoints at most 1.8x one of them (start-up dominates; no per-file torch)."""
    built = build("build_torch_save_files", tmp, copies)
    bn = [PY, "-m", "bnaudit", "inspect"]
    probe = subprocess.run(
        [PY, "-c", _TORCH_PROBE, "inspect", built["one"], "--exit-zero"],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=REPO,
    )
    torch_free = probe.stderr.strip().splitlines()[-1:] == ["NO-TORCH"]
    line("11", "inspect torch.save zip: torch absent from sys.modules", None, None, "yes" if torch_free else "NO")
    runs = compare(
        {
            "base": [PY, "-c", "import typer, rich"],
            "pt": bn + [built["one"]],
            "first": bn + [built["first"]],
            "folder": bn + [built["folder"]],
            "folder_serial": bn + [built["folder"], "--jobs", "1"],
            "st_first": bn + [built["st_first"]],
            "st_folder": bn + [built["st_folder"]],
        },
        repeats,
    )
    t = {k: median_wall(v) for k, v in runs.items()}
    ratio = t["pt"] / t["base"]
    line(
        "11",
        "inspect torch.save zip (ResNet-50) vs import typer, rich",
        ratio if torch_free else float("inf"),
        2.5,
        f"{fmt_s(t['pt'])} vs {fmt_s(t['base'])}" + ("" if torch_free else "; torch was imported"),
    )
    line(
        "11",
        f"inspect a folder of {copies} torch.save files vs one of them",
        t["folder"] / t["first"],
        1.8,
        f"{fmt_s(t['folder'])} vs {fmt_s(t['first'])}",
    )
    line(
        "11",
        f"context: the same folder audited by one process (--jobs 1; {len(os.sched_getaffinity(0))} CPUs usable)",
        None,
        None,
        f"{t['folder_serial'] / t['first']:.2f}x ({fmt_s(t['folder_serial'])} vs {fmt_s(t['first'])})",
    )
    line(
        "11",
        f"context: the same {copies} files as .safetensors vs one of them",
        None,
        None,
        f"{t['st_folder'] / t['st_first']:.2f}x ({fmt_s(t['st_folder'])} vs {fmt_s(t['st_first'])})",
    )
    shutil.rmtree(built["folder"])
    shutil.rmtree(built["st_folder"])
    os.remove(built["one"])


def target_13_html(tmp: str, repeats: int) -> None:
    """--format html of a large model stays usable: inspect of 500 BN layers x 2048 channels
    renders its page in at most 10 s, into at most 5 MiB (the summary strip, the flagged
    layers expanded), and costs at most 12x the JSON report of the same file."""
    from importlib.util import find_spec

    if find_spec("matplotlib") is None:
        skip("13", "inspect --format html, 500 BN layers x 2048 channels", "matplotlib not installed (the html extra)")
        return
    path = build("build_many_layers", os.path.join(tmp, "many_layers.safetensors"))
    page = os.path.join(tmp, "many_layers.html")
    bn = [PY, "-m", "bnaudit", "inspect", path, "--exit-zero"]
    runs = compare(
        {"json": bn + ["--format", "json"], "html": bn + ["--format", "html", "-o", page, "--force"]}, repeats
    )
    t = {k: median_wall(v) for k, v in runs.items()}
    size = os.path.getsize(page)
    what = "html page of 500 BN layers x 2048 channels"
    line("13", f"{what}: wall vs 10 s", t["html"] / 10.0, 1.0, fmt_s(t["html"]))
    line("13", f"{what}: page size vs 5 MiB", size / (5 * MiB), 1.0, f"{size / MiB:.2f} MiB")
    line(
        "13",
        "inspect --format html vs --format json (same file)",
        t["html"] / t["json"],
        12.0,
        f"{fmt_s(t['html'])} vs {fmt_s(t['json'])}",
    )
    os.remove(path)
    os.remove(page)


@dataclass(frozen=True)
class Workload:
    folder: str
    arch: str
    ckpt: str
    data: str
    batch: int


# One intra-op thread in every compared torch process: on a few shared cores, OpenMP's
# spinning threads make multi-threaded timings erratic (10x swings between runs), and both
# sides of each comparison run alike.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def bnaudit_gap(w: Workload, data: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    return [
        PY,
        "-m",
        "bnaudit",
        "gap",
        w.ckpt,
        "--arch",
        w.arch,
        "--data",
        data or w.data,
        "--batch-size",
        str(w.batch),
        "--format",
        "json",
        *extra,
    ]


def bnaudit_recal(w: Workload, output: str, data: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    return [
        PY,
        "-m",
        "bnaudit",
        "recalibrate",
        w.ckpt,
        "--arch",
        w.arch,
        "--data",
        data or w.data,
        "--output",
        output,
        "--force",
        "--batch-size",
        str(w.batch),
        "--format",
        "json",
        *recalibrate_guard_flags(),
        *extra,
    ]


def reference_script(w: Workload, name: str, template: str) -> str:
    path = os.path.join(w.folder, name)
    with open(path, "w") as f:
        f.write(textwrap.dedent(template.format(folder=w.folder, ckpt=w.ckpt, data=w.data, batch=w.batch)))
    return path


def target_3_recalibrate(w: Workload, repeats: int, samples: int) -> None:
    what = "recalibrate --method exact vs torch.optim.swa_utils.update_bn"
    if not command_exists("recalibrate"):
        return skip("3", what, "no `bnaudit recalibrate` command on this branch yet")
    ref = reference_script(w, "ref_update_bn.py", REF_UPDATE_BN)
    out_ref, out_bn = os.path.join(w.folder, "ref_out.pt"), os.path.join(w.folder, "recal_out.pt")
    runs = compare(
        {
            "update_bn": [PY, ref, out_ref],
            "exact": bnaudit_recal(w, out_bn, extra=["--method", "exact"]),
        },
        repeats,
        env=child_env(ONE_THREAD),
    )
    t_ref, t_exact = median_wall(runs["update_bn"]), median_wall(runs["exact"])
    line(
        "3",
        what,
        t_exact / t_ref,
        1.10,
        f"{fmt_s(t_exact)} vs {fmt_s(t_ref)}, {samples} samples, batch {w.batch}, whole processes",
    )


def target_4_gap(w: Workload, repeats: int, samples: int) -> None:
    what = "gap vs one plain eval-mode pass"
    if not command_exists("gap"):
        return skip("4", what, "no `bnaudit gap` command on this branch yet")
    ref = reference_script(w, "ref_eval.py", REF_EVAL)
    runs = compare({"eval": [PY, ref], "gap": bnaudit_gap(w)}, repeats, env=child_env(ONE_THREAD))
    t_ref, t_gap = median_wall(runs["eval"]), median_wall(runs["gap"])
    line(
        "4",
        what,
        t_gap / t_ref,
        2.2,
        f"{fmt_s(t_gap)} vs {fmt_s(t_ref)}, {samples} samples, batch {w.batch}, whole processes",
    )


# invariance's arrangements written out as a plain loop: the same 256 samples (the first
# of the seeded order), alone, in their natural batches of 64 and in batches of 64 of a
# seeded permutation; outputs only, nothing compared.
REF_ARRANGEMENTS = """
import sys, torch
sys.path.insert(0, {folder!r})
from bench_model import wide_net
from safetensors.torch import load_file
model = wide_net()
model.load_state_dict(torch.load({ckpt!r}, map_location="cpu", weights_only=True))
model.eval()
inputs = load_file({data!r})["inputs"]
order = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(0))[:{samples}]
x = inputs[order]
n = len(x)
perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
outputs = []
with torch.no_grad():
    for arrangement in ([torch.tensor([i]) for i in range(n)], torch.arange(n).split({batch}), perm.split({batch})):
        out = torch.empty(n, 10)
        for idx in arrangement:
            out[idx] = model(x[idx])
        outputs.append(out)
print(float(outputs[1].sub(outputs[0]).abs().max()))
"""
INVARIANCE_SAMPLES = 256


def target_9_invariance(w: Workload, ckpt: str, repeats: int) -> None:
    what = "invariance (256 samples) vs a plain loop, same arrangements"
    if not command_exists("invariance"):
        return skip("9", what, "no `bnaudit invariance` command on this branch yet")
    path = os.path.join(w.folder, "ref_arrangements.py")
    with open(path, "w") as f:
        f.write(
            REF_ARRANGEMENTS.format(folder=w.folder, ckpt=ckpt, data=w.data, samples=INVARIANCE_SAMPLES, batch=w.batch)
        )
    arch = f"{os.path.join(w.folder, 'bench_model.py')}:wide_net"
    cmd = [PY, "-m", "bnaudit", "invariance", ckpt, "--arch", arch, "--data", w.data]
    cmd += ["--num-samples", str(INVARIANCE_SAMPLES), "--batch-sizes", f"1,{w.batch}", "--format", "json"]
    runs = compare({"loop": [PY, path], "invariance": cmd}, repeats, env=child_env(ONE_THREAD))
    t_ref, t_inv = median_wall(runs["loop"]), median_wall(runs["invariance"])
    line(
        "9",
        what,
        t_inv / t_ref,
        1.25,
        f"{fmt_s(t_inv)} vs {fmt_s(t_ref)}, wide ResNet, batch sizes 1 and {w.batch}, whole processes",
    )


# diff --data's output comparison written out as plain loops over the same data: the
# export by itself (onnxruntime, sub-batches of its fixed batch of 2, the last padded),
# and the whole comparison (also the torch model in eval mode, batches of 64).
REF_ORT_LOOP = """
import sys, numpy as np, onnxruntime
from safetensors.numpy import load_file
x = load_file({data!r})["inputs"].astype(np.float32)
session = onnxruntime.InferenceSession({onnx!r}, providers=["CPUExecutionProvider"])
if len(x) % 2:
    x = np.concatenate([x, x[-1:]])
outputs = [session.run(None, {{"x": x[i : i + 2]}})[0] for i in range(0, len(x), 2)]
if {torch_too}:
    import torch
    sys.path.insert(0, {folder!r})
    from bench_model import net
    model = net()
    model.load_state_dict(torch.load({ckpt!r}, map_location="cpu", weights_only=True))
    model.eval()
    y = np.concatenate(outputs)
    with torch.no_grad():
        agree = sum(int((model(b).argmax(1).numpy() == y[i * 64 : i * 64 + len(b)].argmax(1)).sum())
                    for i, b in enumerate(torch.from_numpy(x).split(64)))
    print(agree)
"""


# The onnxruntime side alone, in one process: diff --data's run_export over the data in
# batches of 64 against the plain loop, interleaved, medians of `repeats` rounds.
EXPORT_RUN = """
import json, statistics, sys, time, numpy as np, onnxruntime
from safetensors.numpy import load_file
from bnaudit.runtime.parity.onnx import run_export
x = load_file({data!r})["inputs"].astype(np.float32)
session = onnxruntime.InferenceSession({onnx!r}, providers=["CPUExecutionProvider"])
def plain():
    padded = np.concatenate([x, x[-1:]]) if len(x) % 2 else x
    return [session.run(None, {{"x": padded[i : i + 2]}})[0] for i in range(0, len(padded), 2)]
def ours():
    return [run_export(session, "x", x[i : i + {batch}], 2)[0] for i in range(0, len(x), {batch})]
times = {{"plain": [], "ours": []}}
for round_ in range({repeats} + 1):
    for name, run in (("plain", plain), ("ours", ours)):
        start = time.perf_counter()
        run()
        if round_:
            times[name].append(time.perf_counter() - start)
print(json.dumps({{k: statistics.median(v) for k, v in times.items()}}))
"""


def target_12_export_parity(w: Workload, repeats: int, samples: int) -> None:
    what = "diff --data: onnxruntime side vs plain loop, batch-2 export"
    try:
        import onnxruntime  # type: ignore[import-untyped]  # noqa: F401
    except ImportError:
        return skip("12", what, "onnxruntime is not installed (the onnx extra)")
    export = build("build_fixed_batch_onnx", w.folder, w.ckpt)
    script = os.path.join(w.folder, "export_run.py")
    with open(script, "w") as f:
        f.write(EXPORT_RUN.format(data=w.data, onnx=export, batch=w.batch, repeats=repeats))
    proc = subprocess.run([PY, script], capture_output=True, text=True, env=child_env(ONE_THREAD), cwd=REPO)
    if proc.returncode:
        raise RuntimeError(f"{script} failed:\n{proc.stderr[-2000:]}")
    t = json.loads(proc.stdout.strip().splitlines()[-1])
    load = f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    line(
        "12",
        what,
        t["ours"] / t["plain"],
        1.2,
        f"{fmt_s(t['ours'])} vs {fmt_s(t['plain'])}, {samples} samples in batches of {w.batch}, one process, {load}",
    )
    # whole processes, for context: diff also runs the torch model and its float64 copy
    refs = {}
    for name, torch_too in (("ort", False), ("ort+torch", True)):
        refs[name] = os.path.join(w.folder, f"ref_{name.replace('+', '_')}.py")
        with open(refs[name], "w") as f:
            f.write(REF_ORT_LOOP.format(data=w.data, onnx=export, folder=w.folder, ckpt=w.ckpt, torch_too=torch_too))
    cmd = [PY, "-m", "bnaudit", "diff", w.ckpt, export, "--arch", w.arch, "--data", w.data]
    cmd += ["--batch-size", str(w.batch), "--format", "json", "--isolated"]
    runs = compare({"ort": [PY, refs["ort"]], "ort+torch": [PY, refs["ort+torch"]], "diff": cmd}, repeats,
                   env=child_env(ONE_THREAD))  # fmt: skip
    t_ort, t_both, t_diff = (median_wall(runs[k]) for k in ("ort", "ort+torch", "diff"))
    line("12", "diff --data vs a plain onnxruntime loop, whole processes", t_diff / t_ort, None,
         f"{fmt_s(t_diff)} vs {fmt_s(t_ort)}")  # fmt: skip
    line(
        "12",
        "diff --data vs plain torch + onnxruntime loop, processes",
        t_diff / t_both,
        None,
        f"{fmt_s(t_diff)} vs {fmt_s(t_both)} (diff also runs a float64 copy for the noise floor)",
    )


# parity's reference: the same model, data and batches of 64 through eager PyTorch and the
# target, the final outputs compared (largest |difference|, argmax agreement), nothing else.
REF_PARITY = """
import sys, torch
sys.path.insert(0, {folder!r})
from bench_model import net
from safetensors.torch import load_file
model = net()
model.load_state_dict(torch.load({ckpt!r}, map_location="cpu", weights_only=True))
model.eval()
x = load_file({data!r})["inputs"][:{samples}]
if {onnx!r}:
    import onnxruntime
    session = onnxruntime.InferenceSession({onnx!r}, providers=["CPUExecutionProvider"])
    target = lambda b: torch.from_numpy(session.run(None, {{"x": b.numpy()}})[0])
else:
    import copy
    target = torch.compile(copy.deepcopy(model), backend={backend!r})
worst, agree = 0.0, 0
with torch.no_grad():
    for b in x.split({batch}):
        y, t = model(b), target(b)
        worst = max(worst, float((y - t).abs().max()))
        agree += int((y.argmax(1) == t.argmax(1)).sum())
print(worst, agree)
"""


def bnaudit_parity(w: Workload, against: str, samples: int, data: str | None = None) -> list[str]:
    return [PY, "-m", "bnaudit", "parity", w.ckpt, "--arch", w.arch, "--data", data or w.data, "--against", against,
            "--num-samples", str(samples), "--batch-size", str(w.batch), "--format", "json", "--isolated"]  # fmt: skip


def target_14_parity(w: Workload, repeats: int, samples: int) -> None:
    """parity (eager float32 and float64, the target, every BN layer compared) against a plain
    loop of eager and the target comparing final outputs only: whole processes, same batches."""
    targets: list[tuple[str, str, str]] = [("compile:aot_eager", "", "aot_eager")]
    try:
        import onnxruntime  # type: ignore[import-untyped]  # noqa: F401

        targets.insert(0, ("ONNX, BN folded", build("build_folded_onnx", w.folder, w.ckpt), ""))  # type: ignore[arg-type]
    except ImportError:
        skip("14", "parity vs a plain loop, ONNX target", "onnxruntime is not installed (the onnx extra)")
    for label, onnx, backend in targets:
        what = f"parity vs plain eager+target loop ({label})"
        if not command_exists("parity"):
            skip("14", what, "no `bnaudit parity` command on this branch yet")
            continue
        ref = os.path.join(w.folder, f"ref_parity_{backend or 'onnx'}.py")
        with open(ref, "w") as f:
            f.write(REF_PARITY.format(folder=w.folder, ckpt=w.ckpt, data=w.data, samples=samples, onnx=onnx,
                                      backend=backend, batch=w.batch))  # fmt: skip
        against = onnx or f"compile:{backend}"
        runs = compare({"loop": [PY, ref], "parity": bnaudit_parity(w, against, samples)}, repeats,
                       env=child_env(ONE_THREAD))  # fmt: skip
        t_ref, t_par = median_wall(runs["loop"]), median_wall(runs["parity"])
        detail = f"{fmt_s(t_par)} vs {fmt_s(t_ref)}, {samples} samples, batch {w.batch}, 15 BN layers, whole processes"
        line("14", what, t_par / t_ref, 3.0, detail)


def target_15_parity_memory(w: Workload, repeats: int) -> None:
    """parity's peak RSS does not grow with the data: 1,000 samples against 100, batches of 64."""
    what = "parity peak RSS: 1000 vs 100 samples (batch 64)"
    if not command_exists("parity"):
        return skip("15", what, "no `bnaudit parity` command on this branch yet")
    small = build("build_tensor_data", os.path.join(w.folder, "parity_100.safetensors"), 100)
    large = build("build_tensor_data", os.path.join(w.folder, "parity_1000.safetensors"), 1000)
    against = "compile:aot_eager"
    runs = compare({"small": bnaudit_parity(w, against, 100, str(small)),
                    "large": bnaudit_parity(w, against, 1000, str(large))}, repeats, env=child_env(ONE_THREAD))  # fmt: skip
    m_small, m_large = median_rss(runs["small"]), median_rss(runs["large"])
    line("15", what, m_large / m_small, 1.2, f"{fmt_mb(m_large)} vs {fmt_mb(m_small)}, target {against}")


def target_5_memory(
    w: Workload,
    small: str,
    large: str,
    n_small: int,
    repeats: int,
    unit: str = "images",
    extra: Sequence[str] = ("--image-size", "32"),
) -> None:
    for name, exists, build in (
        ("gap", command_exists("gap"), lambda d: bnaudit_gap(w, d, extra)),
        (
            "recalibrate",
            command_exists("recalibrate"),
            lambda d: bnaudit_recal(w, os.path.join(w.folder, "mem_out.pt"), d, extra),
        ),
    ):
        what = f"{name} peak RSS: {10 * n_small} vs {n_small} {unit}"
        if not exists:
            skip("5", what, f"no `bnaudit {name}` command on this branch yet")
            continue
        runs = compare({"small": build(small), "large": build(large)}, repeats, env=child_env(ONE_THREAD))
        m_small, m_large = median_rss(runs["small"]), median_rss(runs["large"])
        line("5", what, m_large / m_small, 1.2, f"{fmt_mb(m_large)} vs {fmt_mb(m_small)}")


def target_6_workers(w: Workload, images: str, n_images: int, repeats: int) -> None:
    what = "gap --workers 2 vs --workers 0 (JPEG decode + resize), wall"
    if not command_exists("gap"):
        return skip("6", what, "no `bnaudit gap` command on this branch yet")
    # One intra-op thread per process, so that overlap (not extra threads for the
    # convolutions) is what --workers can win.
    env = child_env(ONE_THREAD)
    runs = compare(
        {
            "w0": bnaudit_gap(w, images, ["--image-size", "32", "--workers", "0"]),
            "w2": bnaudit_gap(w, images, ["--image-size", "32", "--workers", "2"]),
        },
        repeats,
        env=env,
        watch_children=True,
    )
    t0, t2 = median_wall(runs["w0"]), median_wall(runs["w2"])
    kids0 = max(r.max_children for r in runs["w0"])
    kids2 = min(r.max_children for r in runs["w2"])
    main0 = statistics.median(r.main_cpu for r in runs["w0"])
    main2 = statistics.median(r.main_cpu for r in runs["w2"])
    workers2 = statistics.median(r.cpu - r.main_cpu for r in runs["w2"])
    line(
        "6",
        "gap --workers 2: worker processes seen (min over runs)",
        None,
        None,
        f"{kids2} with --workers 2, {kids0} with --workers 0",
    )
    line(
        "6",
        "gap CPU time: main process with --workers 2 vs 0",
        main2 / main0,
        None,
        f"main {main2:.2f} s vs {main0:.2f} s; the workers used {workers2:.2f} s (decoding moved out of the forward's process)",
    )
    ratio = t2 / t0 if kids2 >= 2 and kids0 == 0 else float("inf")
    detail = f"{fmt_s(t2)} vs {fmt_s(t0)}, {n_images} images, OMP_NUM_THREADS=1, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    if ratio == float("inf"):
        detail += "; no DataLoader worker processes seen"
    line("6", what, ratio, 0.90, detail)


# ----------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller inputs and fewer repeats")
    parser.add_argument("--repeats", type=int, help="measured rounds per comparison (default 5, quick 3)")
    parser.add_argument("--only", help="comma list of targets to run, e.g. 1,2")
    parser.add_argument("--tmp", help="folder for the temporary inputs (default: the system's)")
    parser.add_argument("--repo", help="checkout whose bnaudit is measured (default: this one)")
    parser.add_argument("--against", help="another checkout measured beside this one (target 2: start-up)")
    parser.add_argument("--build", nargs=2, metavar=("FUNCTION", "JSON_ARGS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    global REPO
    REPO = os.path.abspath(args.repo) if args.repo else REPO
    if args.build:  # a child started by build()
        print(json.dumps(BUILDERS[args.build[0]](*json.loads(args.build[1]))))
        return 0
    only = {int(x) for x in args.only.split(",")} if args.only else set(range(1, 16))
    repeats = args.repeats or (3 if args.quick else 5)
    extra_bytes = 256 * MiB if args.quick else GiB
    samples = 512 if args.quick else 2048
    n_images = 100 if args.quick else 300

    tmp = tempfile.mkdtemp(prefix="bnaudit-bench-", dir=args.tmp)
    started = time.perf_counter()
    print(
        f"bnaudit benchmarks ({'quick' if args.quick else 'full'}; {repeats} interleaved rounds after a "
        f"warm-up; medians; {os.cpu_count()} CPUs)",
        flush=True,
    )
    print(f"{'#':>2}  {'comparison':<58} {'ratio':>7}  {'target':<13} {'':<4}  detail", flush=True)
    try:
        files: dict[str, str] = {}
        if 1 in only:
            files = target_1_size_independence(tmp, extra_bytes, repeats)
        if 2 in only:
            target_2_startup(tmp, files.get("st_small"), files.get("pt_small"), max(repeats * 3, 9), args.against)
        for key in ("st_big", "pt_big"):  # free the disk before the data-heavy targets
            if key in files:
                os.remove(files[key])
        if 7 in only:
            target_7_diff_size_independence(tmp, extra_bytes, repeats)
        if 8 in only:
            target_8_sharded(tmp, extra_bytes, repeats)
        if 10 in only:
            target_10_onnx_external_data(tmp, extra_bytes, repeats)
        if 11 in only:
            target_11_torch_save_without_torch(tmp, max(repeats * 2, 7))
        if 13 in only:
            target_13_html(tmp, repeats)
        if only & {3, 4, 5, 6, 9, 12, 14, 15}:
            folder = os.path.join(tmp, "model")
            os.makedirs(folder)
            ckpt = build("build_small_model", folder)
            data = build("build_tensor_data", os.path.join(folder, "data.safetensors"), samples)
            w = Workload(folder, f"{os.path.join(folder, 'bench_model.py')}:net", ckpt, data, 64)
            if 3 in only:
                target_3_recalibrate(w, repeats, samples)
            if 4 in only:
                target_4_gap(w, repeats, samples)
            if 9 in only:
                target_9_invariance(w, build("build_wide_model", folder), repeats)
            if 12 in only:
                target_12_export_parity(w, repeats, samples)
            if 14 in only:
                target_14_parity(w, repeats, samples)
            if 15 in only:
                target_15_parity_memory(w, max(repeats - 2, 1))
            if only & {5, 6}:
                small = build("build_image_folder", os.path.join(tmp, "images_small"), n_images)
                large = build("build_image_folder", os.path.join(tmp, "images_large"), n_images * 10)
                if 5 in only:
                    target_5_memory(w, small, large, n_images, repeats)
                    # tensor files too (read batch by batch, not memory-mapped); one measured
                    # round: peak RSS does not swing like wall time
                    n_rows = 256 if args.quick else 512
                    rows_small = build("build_tensor_data", os.path.join(folder, "rows_small.safetensors"), n_rows)
                    rows_large = build("build_tensor_data", os.path.join(folder, "rows_large.safetensors"), 10 * n_rows)
                    target_5_memory(w, rows_small, rows_large, n_rows, 1, "samples of a tensor file", ())
                if 6 in only:
                    target_6_workers(w, large, n_images * 10, repeats)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"done in {time.perf_counter() - started:.0f} s", flush=True)
    return 1 if any(" FAIL " in r for r in RESULTS) else 0


if __name__ == "__main__":
    sys.exit(main())
