#!/usr/bin/env python3
"""Screenshot a report.html (or any HTML file) with headless Chromium, as a real browser renders it.

    python tools/screenshot_report.py REPORT_HTML OUT_PNG [--width 1400] [--height 0] [--browser PATH]

--height 0 (the default) captures the whole page: the page is first measured (its scrollHeight, via
--dump-dom of a tiny script) and the window made that tall, up to --max-height pixels. Chromium is looked
up as chromium, chromium-browser, google-chrome (install: apt-get install -y chromium).
Also prints, from the rendered DOM, every table wider than its box that does not scroll inside its own
wrapper, and every literal backtick in the visible text: the checks the report's layout should pass.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = """
<script>
window.addEventListener('load', () => {
  const out = [];
  out.push('HEIGHT ' + document.documentElement.scrollHeight);
  out.push('WIDTH ' + document.documentElement.scrollWidth);
  document.querySelectorAll('table').forEach((t, i) => {
    const box = t.parentElement;
    const scrolls = getComputedStyle(box).overflowX === 'auto' || getComputedStyle(box).overflowX === 'scroll';
    if (t.scrollWidth > document.body.clientWidth && !scrolls) out.push('OVERFLOW table ' + i);
  });
  const text = document.body.innerText;
  const ticks = (text.match(/`/g) || []).length;
  out.push('BACKTICKS ' + ticks);
  const pre = document.createElement('pre');
  pre.id = 'kl-bench-probe';
  pre.textContent = out.join('\\n');
  document.body.appendChild(pre);
});
</script>
"""


def find_browser(given: str | None) -> str:
    for name in ([given] if given else ["chromium", "chromium-browser", "google-chrome", "google-chrome-stable"]):
        path = shutil.which(name) if name else None
        if path:
            return path
    sys.exit("no Chromium found: install it (apt-get install -y chromium) or pass --browser PATH")


def base_args(browser: str, width: int, height: int, profile: str) -> list[str]:
    return [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--force-device-scale-factor=1",
            f"--user-data-dir={profile}", f"--window-size={width},{height}", "--virtual-time-budget=5000"]


def measure(browser: str, html: Path, width: int, profile: str) -> tuple[int, list[str]]:
    """(page height at this width, layout findings) from a copy of the page with a probe script."""
    with tempfile.NamedTemporaryFile("w", suffix=".html", dir=html.parent, delete=False, encoding="utf-8") as f:
        f.write(html.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"))
        probe_path = Path(f.name)
    try:
        dom = subprocess.run(base_args(browser, width, 900, profile) + ["--dump-dom", probe_path.as_uri()],
                             capture_output=True, text=True, timeout=120).stdout
    finally:
        probe_path.unlink()
    m = re.search(r'<pre id="kl-bench-probe">(.*?)</pre>', dom, re.S)
    lines = m.group(1).splitlines() if m else []
    height = next((int(x.split()[1]) for x in lines if x.startswith("HEIGHT ")), 3000)
    return height, [x for x in lines if not x.startswith("HEIGHT ")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("html", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--height", type=int, default=0, help="window height; 0: the whole page")
    ap.add_argument("--max-height", type=int, default=16000)
    ap.add_argument("--browser")
    a = ap.parse_args()
    browser = find_browser(a.browser)
    html = a.html.resolve()
    with tempfile.TemporaryDirectory() as profile:
        height, findings = measure(browser, html, a.width, profile)
        for line in findings:
            print(line)
        h = a.height or min(height, a.max_height)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(base_args(browser, a.width, h, profile) + [f"--screenshot={a.out.resolve()}",
                              html.as_uri()], capture_output=True, text=True, timeout=180)
    if not a.out.exists():
        sys.exit(f"chromium wrote no screenshot: {proc.stderr[-2000:]}")
    print(f"{a.out} ({a.width}x{h})")


if __name__ == "__main__":
    main()
