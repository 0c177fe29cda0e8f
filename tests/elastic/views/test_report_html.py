"""report.html: self-contained, deterministic, and it renders its charts in a real browser."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from elastic.views.report import build_report
from elastic.views.report_html import COLORS, color, render_html, write_report
from tests.elastic.views.test_report_costs import T0, wasteful_run

CHARTS = 7   # loss, world size, cumulative USD, VM prices, timeline; bars: waste by cause, USD by cloud and region


def write_run(run_dir: Path, events: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events), encoding="utf-8")


def richer_run() -> list[dict]:
    """The wasteful run with a few more outer steps and a price change, so every chart has a shape."""
    events = wasteful_run()
    extra = [{"t": T0 + 60, "type": "node_price", "instance_id": "a", "usd_per_hour": 0.50},
             {"t": T0 + 130, "type": "node_notice", "instance_id": "b", "deadline": T0 + 150, "notice_s": 20}]
    for n, t in enumerate((T0 + 210, T0 + 240, T0 + 270), start=2):
        extra.append({"t": t, "type": "outer_step", "outer_step": n, "inner_step": 10 * n, "epoch": 1,
                      "replicas": [0], "losses": [3.0 - 0.3 * n, 2.9 - 0.3 * n], "tokens": 500,
                      "tokens_total": 1000 + 500 * (n - 1), "inner_s": 25.0, "sync_s": 1.0,
                      "bytes_sent": 1_000_000, "data_cursor": 10 * n})
    return sorted(events + extra, key=lambda e: e["t"])


def test_html_is_self_contained_and_rebuilt_byte_identical(tmp_path):
    write_run(tmp_path, richer_run())
    write_report(tmp_path)
    html = (tmp_path / "report.html").read_text(encoding="utf-8")
    first_json = (tmp_path / "report.json").read_bytes()
    assert html.count('<svg class="chart"') == CHARTS
    # Nothing fetched: no script, stylesheet link, image, import or url(); the only URL is SVG's namespace.
    for needle in ("<script", "<link", "<img", "<iframe", "@import", "url(", "src="):
        assert needle not in html, needle
    assert set(re.findall(r"https?://[^\s\"']+", html)) == {"http://www.w3.org/2000/svg"}
    assert "elastic run costs" in html and "never joined" in html
    write_report(tmp_path)
    assert (tmp_path / "report.html").read_text(encoding="utf-8") == html
    assert (tmp_path / "report.json").read_bytes() == first_json


def test_html_of_empty_and_running_ledgers():
    assert "nothing recorded yet" in render_html([], build_report([]))
    running = richer_run()[:8]
    html = render_html(running, build_report(running))
    assert html.count('<svg class="chart"') == CHARTS and "running" in html


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def render(browser: str, page: Path, out: Path, width_px: int = 1000) -> tuple[list[str], "object"]:
    """Open `page` in headless Chromium: its console messages and a screenshot (a PIL image)."""
    from PIL import Image

    shot = out / f"{page.stem}.png"
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
         f"--user-data-dir={out / 'profile'}", "--hide-scrollbars", f"--window-size={width_px},4200",
         f"--screenshot={shot}", page.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert shot.exists(), proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    return console, Image.open(shot).convert("RGB")


def near(img, rgb: tuple[int, int, int], tol: int = 40) -> int:
    """Pixels within `tol` (per channel) of `rgb`."""
    return sum(n for n, px in img.getcolors(maxcolors=1 << 24)
               if all(abs(a - b) <= tol for a, b in zip(px, rgb)))


def hex_rgb(color: str) -> tuple[int, int, int]:
    return tuple(int(color[i:i + 2], 16) for i in (1, 3, 5))


@pytest.mark.skipif(chromium() is None, reason="Chromium is not installed (apt-get install chromium; .ci/run does)")
def test_html_renders_its_charts_in_headless_chromium(tmp_path):
    browser = chromium()
    # The harness sees a page's console errors and uncaught exceptions (else "no errors" means nothing).
    bad = tmp_path / "bad.html"
    bad.write_text('<p>x</p><script>console.error("boom-console"); throw new Error("boom-throw")</script>')
    console, _ = render(browser, bad, tmp_path)
    assert any("boom-console" in line for line in console) and any("boom-throw" in line for line in console)

    run_dir = tmp_path / "run"
    write_run(run_dir, richer_run())
    write_report(run_dir)
    # In a 1400 px window (one browser start: each costs seconds of CPU).
    console, img = render(browser, run_dir / "report.html", tmp_path, width_px=1400)
    assert console == []
    colors = img.getcolors(maxcolors=1 << 24)
    assert len(colors) > 50, "a blank or near-blank screenshot"
    # Drawn lines and bars, in the charts' own colours: loss and billed USD (blue), on-demand and
    # preempted VM (red), replicas in the world (green), notice (orange).
    for c in (COLORS[0], COLORS[3], COLORS[2], COLORS[1]):
        assert near(img, hex_rgb(c)) > 200, c

    # The charts use the page's width: the charts' background spans it.
    chart_bg = hex_rgb("#fafafa")
    columns = {x for x in range(0, img.width, 4) for y in range(0, img.height, 16)
               if all(abs(a - b) <= 2 for a, b in zip(img.getpixel((x, y)), chart_bg))}
    assert max(columns) - min(columns) > 0.9 * img.width, (min(columns), max(columns), img.width)
    # No series hidden under another: "VMs held" (purple, wide and dashed, drawn first) shows beside
    # "replicas in the world" (green, on top) though the two counts are often equal.
    assert near(img, hex_rgb(COLORS[4]), tol=30) > 300
    assert near(img, hex_rgb(COLORS[2]), tol=30) > 300


def test_series_colours_never_repeat():
    assert len({color(n) for n in range(60)}) == 60



def test_a_waste_chart_of_figures_that_all_read_zero_draws_no_bar():
    events = richer_run()
    report = build_report(events)
    report["wasted_usd"] = {k: 0.0 for k in report["wasted_usd"]} | {"preemption": 0.00002, "total": 0.00002}
    waste = render_html(events, report).split("USD wasted, by cause")[1].split("<h2>")[0]
    assert "<rect" not in waste and "every figure is under $0.0001" in waste
