"""Rewrite docs/images/inspect-html.png, the README's picture of an html page, from a real run.

    python tools/html_screenshot.py        # needs the html extra (matplotlib) and Chromium

Runs `bnaudit inspect sample_models/dead_channel.safetensors --format html`, has headless
Chromium take a screenshot at a desktop width, keeps the top of the page (the header, the
summary strip, the layer table, the findings and the flagged layer) and stores it with a
128-colour palette, which keeps the file small.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(REPO, "docs", "images", "inspect-html.png")
WIDTH, HEIGHT, KEEP = 1100, 2000, 1560


def main() -> int:
    chromium = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    if chromium is None:
        print("html_screenshot: Chromium is not installed", file=sys.stderr)
        return 2
    from PIL import Image

    with tempfile.TemporaryDirectory() as tmp:
        page, shot = os.path.join(tmp, "inspect.html"), os.path.join(tmp, "shot.png")
        env = {**os.environ, "PYTHONPATH": REPO}
        command = ["inspect", "sample_models/dead_channel.safetensors", "--format", "html", "-o", page]
        subprocess.run([sys.executable, "-m", "bnaudit", *command], cwd=REPO, env=env, check=False)
        subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--no-first-run",
                f"--user-data-dir={os.path.join(tmp, 'profile')}",
                f"--window-size={WIDTH},{HEIGHT}",
                f"--screenshot={shot}",
                f"file://{page}",
            ],
            check=True,
            capture_output=True,
        )
        with Image.open(shot) as image:
            kept = image.convert("RGB").crop((0, 0, WIDTH, KEEP))
            kept.quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(TARGET, optimize=True)
    print(f"wrote {os.path.relpath(TARGET, REPO)} ({os.path.getsize(TARGET) // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
