"""The dashboard's chart axes in real headless Chromium: small magnitudes (a learning rate of 5e-6, losses near
1e-3, log-prob gaps) get labels that say their value, one label per tick, none of them a wrong "0"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_dashboard import ARTIFACTS, CHROMIUM, ROOT, colours

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium not installed"),
]
STATIC = ROOT / "api" / "static"
STEPS = list(range(1, 21))
#: chart -> values: warm-up of a small learning rate, a loss near 1e-3, a gap around zero, large token counts.
SERIES = {
    "lr": [5e-6 * min(1.0, s / 10) for s in STEPS],
    "loss": [1.0e-3 + 2e-5 * s for s in STEPS],
    "gap": [(-1) ** s * 3e-4 / s for s in STEPS],
    "tokens": [2.0e6 + 1e4 * s for s in STEPS],
    "reward": [s / 20 for s in STEPS],
}


@pytest.fixture()
def chart_page():
    """A blank page with the dashboard's uPlot, stylesheet and charts.js: no service needed."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
        )
        yield from _page(browser)
        browser.close()


def _page(browser):
    ctx = browser.new_context(viewport={"width": 900, "height": 1200})
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    divs = "".join(f'<div class="chart" id="chart-{name}"></div>' for name in SERIES)
    page.set_content(f"<html><body>{divs}</body></html>")
    page.add_style_tag(path=str(STATIC / "vendor" / "uPlot.min.css"))
    page.add_style_tag(path=str(STATIC / "style.css"))
    for script in (STATIC / "vendor" / "uPlot.iife.min.js", STATIC / "charts.js"):
        page.add_script_tag(path=str(script))
    yield page
    assert not errors, errors
    ctx.close()


def test_small_values_get_distinct_true_tick_labels(chart_page):
    page = chart_page
    page.evaluate(
        """([steps, series]) => { for (const [name, values] of Object.entries(series))
             Charts.draw(document.getElementById("chart-" + name), name, steps, [{ label: name, values }]); }""",
        [STEPS, SERIES],
    )
    for name, values in SERIES.items():
        el = page.locator(f"#chart-{name}")
        labels = el.locator(".uplot").get_attribute("data-ticks1").split("|")
        shown = [label for label in labels if label]
        assert len(shown) >= 2 and len(set(shown)) == len(shown), (name, labels)
        lo, hi = min(values), max(values)
        ticks = [float(label) for label in shown]
        assert all(lo - (hi - lo) <= t <= hi + (hi - lo) for t in ticks), (name, labels)
        assert ticks == sorted(ticks) and any(t != 0 for t in ticks), (name, labels)
        assert colours(el.locator("canvas").screenshot()) > 10, f"{name} chart is blank"
    over = page.locator("#chart-lr .u-over")  # hovering shows the value in the legend, not "0"
    box = over.bounding_box()
    over.hover(position={"x": box["width"] * 0.9, "y": box["height"] / 2})
    assert page.locator("#chart-lr .u-legend .u-value").last.inner_text() == "5.000e-6"
    assert page.evaluate("Charts.valueLabel(null, 5e-6)") == "5.000e-6"
    assert page.evaluate("Charts.valueLabel(null, 0.00123456)") == "0.001235"
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "chart-ticks.png"), full_page=True)
    print(json.dumps({n: page.locator(f"#chart-{n} .uplot").get_attribute("data-ticks1") for n in SERIES}))
