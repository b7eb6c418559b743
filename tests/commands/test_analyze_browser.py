"""report.html in a real browser: headless Chromium (Debian's `chromium`, installed here only when
missing) renders it, takes a screenshot, and reports from inside the page that every <img> decoded (natural
width > 0) and that the page fetched nothing (the Resource Timing API lists every resource a page loads, data:
URIs excepted). A copy of the page with one external image and stylesheet shows the check can fail."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from upcycle.analyze.run import AnalyzeOptions, analyze

pytestmark = pytest.mark.slow

# appended to a copy of the page: runs after everything loaded and writes its findings into the DOM, which
# --dump-dom prints (the report itself has no script)
PROBE = """<script>
window.addEventListener('load', () => {
  const images = Array.from(document.images).map(i => ({src: i.src.slice(0, 40), width: i.naturalWidth}));
  const fetched = performance.getEntriesByType('resource').map(e => e.name);
  const out = document.createElement('pre');
  out.id = 'probe';
  out.textContent = JSON.stringify({images, fetched});
  document.body.appendChild(out);
});
</script>"""
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--hide-scrollbars"]


def _install_chromium() -> str | None:
    """Why Chromium could not be installed, or None once it is there."""
    if shutil.which("apt-get") is None or (hasattr(os, "geteuid") and os.geteuid() != 0):
        return "chromium is missing and apt-get is not available to root here"
    for command in (["apt-get", "install", "-y", "-q", "chromium"], ["apt-get", "update", "-q"],
                    ["apt-get", "install", "-y", "-q", "chromium"]):
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
        except subprocess.TimeoutExpired:
            return f"{' '.join(command)} timed out"
        if command[1] == "install" and done.returncode == 0:
            return None
    return f"apt-get install chromium failed: {done.stderr.strip()[-300:]}"


@pytest.fixture(scope="module")
def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        why = _install_chromium()
        found = shutil.which("chromium") or shutil.which("chromium-browser")
        if found is None:
            pytest.skip(f"no headless browser: {why}")
    return found


def probe(chromium: str, page: Path) -> dict:
    """What the page reports about itself once loaded in Chromium."""
    probed = page.with_name("probe-" + page.name)
    probed.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    done = subprocess.run([chromium, *FLAGS, "--virtual-time-budget=10000", "--dump-dom", probed.as_uri()],
                          capture_output=True, text=True, timeout=120)
    found = re.search(r'<pre id="probe">(.*?)</pre>', done.stdout, re.S)
    assert found, f"no probe output from chromium: {done.stderr[-500:]}"
    return json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))


def screenshot(chromium: str, page: Path, png: Path, width: int = 1100, height: int = 3000) -> None:
    subprocess.run([chromium, *FLAGS, f"--screenshot={png}", f"--window-size={width},{height}", page.as_uri()],
                   capture_output=True, timeout=120, check=True)


def test_the_report_renders_offline_with_every_figure_decoded(chromium, tiny_lm, tmp_path):
    _, moe, train_txt, held = tiny_lm
    analyze(str(moe), str(tmp_path / "a"), AnalyzeOptions(sources=(f"toy={train_txt}", f"held={held}"), tokens=192,
                                                          sequence_length=32, output_tokens=64), progress=False)
    page = tmp_path / "a" / "report.html"
    found = probe(chromium, page)
    assert len(found["images"]) == len(list((tmp_path / "a").glob("*.png"))) >= 5
    assert all(image["width"] > 0 for image in found["images"]), found["images"]
    assert found["fetched"] == []
    screenshot(chromium, page, tmp_path / "shot.png")
    assert (tmp_path / "shot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "shot.png").stat().st_size > 20_000          # a page with figures, not a blank one

    # the same check on a page that loads an image and a stylesheet from elsewhere (a closed local port)
    bad = tmp_path / "a" / "bad.html"
    bad.write_text(page.read_text().replace("<body>", '<body><link rel="stylesheet" href="http://127.0.0.1:9/s.css">'
                                                      '<img src="http://127.0.0.1:9/x.png">', 1))
    found = probe(chromium, bad)
    assert any(image["width"] == 0 for image in found["images"])
    assert sorted(found["fetched"]) == ["http://127.0.0.1:9/s.css", "http://127.0.0.1:9/x.png"]
