"""The html pages in a real browser: headless Chromium renders each sample report at a desktop
(1280 px) and a phone (390 px) width, offline, with no console message and no network request,
and a screenshot of each is kept as a test artifact (under pytest's tmp_path).

What the browser fetched is read from its own network log (`--log-net-log`): a request whose
network isolation key is the page's (file://) is one the page made; Chromium's own
background requests carry other keys. Console messages are read from its log on stderr
(`--enable-logging=stderr`: `CONSOLE` lines). Both checks are shown to fail on a page that
does what they look for. Skipped where Chromium is not installed (Debian: `apt-get install
chromium`; .ci/run installs it where apt-get can run unattended).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from conftest import SAMPLES
from typer.testing import CliRunner

from bnaudit.cli import app

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None, reason="headless Chromium is not installed (Debian: apt-get install chromium)"
    ),
]
pytest.importorskip("matplotlib")

VAL = f"{SAMPLES}/data/digits_val.safetensors"
CALIB = f"{SAMPLES}/data/digits_calib.safetensors"
ARCH = f"{SAMPLES}/digits_net.py:digits_net"
WIDTHS = {"desktop": 1280, "phone": 390}

COMMANDS = {
    "inspect": ["inspect", *(f"{SAMPLES}/{n}" for n in ("dead_channel.safetensors", "reset_stats.pt", "healthy.pt"))],
    "diff": ["diff", f"{SAMPLES}/pretrained.safetensors", f"{SAMPLES}/finetuned.pt"],
    "fold": ["fold", f"{SAMPLES}/inception_channel.safetensors"],
    "gap": ["gap", f"{SAMPLES}/immature.pt", "--arch", ARCH, "--data", VAL, "--num-samples", "200"],
    "invariance": [
        "invariance",
        f"{SAMPLES}/traced_train.pt",
        "--data",
        VAL,
        "--batch-sizes",
        "1,8",
        "--num-samples",
        "64",
    ],
    # a compiled target whose second BN call runs with another eps: a first divergent layer to mark
    "parity": [
        "parity",
        f"{SAMPLES}/healthy.pt",
        "--arch",
        ARCH,
        "--data",
        VAL,
        "--num-samples",
        "64",
        "--against",
        f"compile:{SAMPLES}/faulty_backend.py:faulty",
    ],
}


def render(page: str, width: int, screenshot: str, workdir) -> tuple[list[str], list[str]]:
    """Open `page` in headless Chromium at `width` px: (console lines, URLs the page requested)."""
    netlog = os.path.join(workdir, f"net-{width}.json")
    proc = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",  # root in a container; the page runs no script anyway
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            "--disable-background-networking",
            f"--user-data-dir={os.path.join(workdir, f'profile-{width}')}",
            "--enable-logging=stderr",
            "--v=0",
            f"--log-net-log={netlog}",
            f"--window-size={width},2400",
            f"--screenshot={screenshot}",
            f"file://{page}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    with open(netlog, encoding="utf-8") as fh:
        log = json.load(fh)
    start = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    requested = [
        e["params"]["url"]
        for e in log["events"]
        if e["type"] == start
        and e.get("params", {}).get("network_isolation_key", "").startswith("file://")
        and not e["params"]["url"].startswith(("file:", "data:"))
    ]
    return console, requested


def assert_drawn(screenshot: str, width: int) -> None:
    """A screenshot of the width asked, with more than a blank page on it."""
    from PIL import Image

    with Image.open(screenshot) as image:
        assert image.size == (width, 2400)
        colours = image.convert("RGB").getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 50  # text, badges, charts: far more than a blank page's few


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pages")
    made = {}
    for kind, args in COMMANDS.items():
        path = str(folder / f"{kind}.html")
        result = CliRunner().invoke(app, [*args, "--format", "html", "-o", path])
        assert result.exit_code in (0, 1) and os.path.exists(path), result.output
        made[kind] = path
    path = str(folder / "recalibrate.html")
    args = ["recalibrate", f"{SAMPLES}/reset_stats.pt", "--arch", ARCH, "--data", CALIB, "--eval-data", VAL]
    result = CliRunner().invoke(app, [*args, "-o", str(folder / "new.pt"), "-f", "html", "--report", path])
    assert result.exit_code == 0, result.output
    made["recalibrate"] = path
    return made


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("kind", [*COMMANDS, "recalibrate"])
def test_each_page_renders_offline_without_a_console_message(pages, kind, width, tmp_path):
    screenshot = str(tmp_path / f"{kind}-{width}.png")  # kept: pytest's tmp_path is the artifact
    console, requested = render(pages[kind], WIDTHS[width], screenshot, tmp_path)
    assert console == [] and requested == []
    assert_drawn(screenshot, WIDTHS[width])


def test_the_checks_see_a_console_message_and_a_request(tmp_path):
    page = tmp_path / "bad.html"
    page.write_text(
        '<!DOCTYPE html><html><body><p>x</p><img src="http://example.invalid/x.png">'
        '<script>console.error("boom")</script></body></html>'
    )
    console, requested = render(str(page), 390, str(tmp_path / "bad.png"), tmp_path)
    assert any('"boom"' in line for line in console)
    assert requested == ["http://example.invalid/x.png"]
