"""The dashboard in real headless Chromium over a real service with real tiny jobs (tests/embedded_service.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium not installed"),
]


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
        )
        yield b
        b.close()


@pytest.fixture()
def page(browser, embedded_service):
    url, key, *_ = embedded_service
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url + "/")
    page.evaluate(f"localStorage.setItem('gspo_api_key', {key!r})")
    yield page
    assert not errors, errors
    ctx.close()


def colours(png: bytes) -> int:
    import io

    from PIL import Image

    return len(Image.open(io.BytesIO(png)).convert("RGB").getcolors(1 << 24) or [])


def test_jobs_list(page, embedded_service):
    url, _, job_id, _, sft_id = embedded_service
    ARTIFACTS.mkdir(exist_ok=True)
    page.goto(url + "/")
    page.wait_for_selector("body[data-jobs-ready='1']")
    row = page.locator(f"tr[data-job='{job_id}']")
    assert "succeeded" in row.inner_text() and "12/12" in row.inner_text()
    assert row.locator("svg.spark polyline").count() == 1
    sft = page.locator(f"tr[data-job='{sft_id}']")  # a supervised job shows its loss
    assert "4/4" in sft.inner_text() and " loss" in sft.inner_text() and sft.locator("svg.spark").count() == 1
    page.screenshot(path=str(ARTIFACTS / "dashboard-jobs.png"), full_page=True)


def test_job_page_charts_inspector_and_download(page, embedded_service):
    url, _, job_id, *_ = embedded_service
    page.goto(f"{url}/jobs/{job_id}")
    page.wait_for_selector("body[data-charts-ready='1']")
    page.wait_for_selector("body[data-stream-ended='1']")  # the live stream replayed and closed
    assert page.get_attribute("body", "data-points") == "12"
    for chart in ("reward", "clip", "ratio", "gap", "time", "tps", "entropy", "length"):
        el = page.locator(f"#chart-{chart}")
        assert el.get_attribute("data-points") == "12", chart
        assert colours(el.locator("canvas").screenshot()) > 10, f"{chart} chart is blank"
    page.wait_for_selector("body[data-samples-ready='1']")
    assert page.locator("#samples .completion").count() == 4 * 8
    assert "Prompt:" in page.locator("#samples").inner_text()
    assert "succeeded" in page.locator("#job-status").inner_text()
    assert '"clip_eps_low": 0.0003' in page.locator("#config").inner_text()
    assert page.locator("#chart-eval").is_hidden()  # the job has no validation file
    page.screenshot(path=str(ARTIFACTS / "dashboard-job.png"), full_page=True)
    with page.expect_download() as dl:
        page.locator("a.download").last.click()
    path = dl.value.path()
    assert dl.value.suggested_filename.endswith(".tar.gz") and Path(path).stat().st_size > 1000


def test_supervised_job_page(page, embedded_service):
    """A supervised job (either API) shows its loss and none of the reinforcement charts."""
    url, *_, sft_id = embedded_service
    page.goto(f"{url}/jobs/{sft_id}")
    page.wait_for_selector("body[data-charts-ready='1']")
    loss = page.locator("#chart-loss")
    assert loss.is_visible() and loss.get_attribute("data-points") == "4"
    assert colours(loss.locator("canvas").screenshot()) > 10
    for chart in ("reward", "clip", "ratio", "time"):
        assert page.locator(f"#chart-{chart}").is_hidden(), chart
    assert page.locator("#ckpt-metric").text_content() == "Loss"
    assert page.locator("#checkpoints a.download").count() >= 1


def test_compare_page(page, embedded_service):
    url, _, job_id, second, _ = embedded_service
    page.goto(f"{url}/compare?jobs={job_id},{second}")
    page.wait_for_selector("body[data-compare-ready='2']")
    assert colours(page.locator("#compare-chart canvas").screenshot()) > 10
    page.screenshot(path=str(ARTIFACTS / "dashboard-compare.png"), full_page=True)


def test_an_environment_job_page_shows_its_items_and_before_to_after(page, embedded_service):
    """A job on a reasoning-gym environment (made here, in the shared service): its page shows the environment
    with its first items, the held-out evaluation before -> after, and each evaluated checkpoint against it."""
    from gspo_client import Client
    from tests.api.test_environments import ENV, HP

    url, key, *_ = embedded_service
    with Client(url, key) as c:
        job = c.create_job(model="toy", environment=ENV, hyperparameters=HP, name="environment")
        for _ in c.events(job["id"]):
            pass
        job = c.get_job(job["id"])
    assert job["status"] == "succeeded", job
    page.goto(f"{url}/jobs/{job['id']}")
    page.wait_for_selector("body[data-charts-ready='1']")
    page.wait_for_selector("#environment-samples .sample")
    assert page.locator("#environment-samples .sample").count() == 3
    assert '"basic_arithmetic"' in page.locator("#environment").inner_text()
    before, after = job["evaluation"]["before"], job["evaluation"]["after"]
    greedy = page.locator("#evaluation .eval-line[data-name='greedy_reward']").inner_text()
    assert greedy.split(" ", 2)[2] == f"{before['greedy_reward']:.3f} → {after['greedy_reward']:.3f}", greedy
    assert page.locator("#chart-eval").is_visible() and page.locator("#chart-eval").get_attribute("data-points") == "3"
    final = page.locator("#checkpoints tr").first.inner_text()  # newest first: the final one, evaluated
    assert f"{before['greedy_reward']:.3f} → {after['greedy_reward']:.3f}" in final, final
    page.screenshot(path=str(ARTIFACTS / "dashboard-environment-job.png"), full_page=True)


def test_an_openenv_job_page_shows_its_server_with_the_headers_redacted(page, embedded_service):
    """A job on a tenant's OpenEnv server (made here and cancelled: the page shows its spec, not its run): the
    environment box shows the server and its turns, never the header's value, and the rows as reset seeds."""
    from gspo_client import Client
    from tests.api.test_environments import HP, OPENENV

    url, key, *_ = embedded_service
    with Client(url, key) as c:
        job = c.create_job(model="toy", environment=OPENENV, hyperparameters=HP, name="openenv")
        c.cancel_job(job["id"])
    page.goto(f"{url}/jobs/{job['id']}")
    page.wait_for_selector("#environment-samples .sample")
    shown = page.locator("#environment").inner_text()
    assert OPENENV["url"] in shown and '"max_turns": 4' in shown and "[redacted]" in shown
    assert "tenant-secret" not in page.content()
    assert page.locator("#environment-samples .sample").first.inner_text().startswith("reset seed 0")


def test_the_tenants_tinker_sessions_show_beside_its_jobs(page, embedded_service):
    """A session the tenant opened (with a model queued; no session worker runs here) is listed with its model
    and state; once finished, as closed."""
    import httpx

    url, key, *_ = embedded_service
    headers = {"X-API-Key": f"tml-{key}"}
    session_id = httpx.post(f"{url}/api/v1/create_session", json={"tags": []}, headers=headers).json()["session_id"]
    body = {"session_id": session_id, "model_seq_id": 0, "base_model": "toy", "lora_config": {"rank": 2}}
    assert httpx.post(f"{url}/api/v1/create_model", json=body, headers=headers).status_code == 200
    page.goto(url + "/")
    page.wait_for_selector("body[data-sessions-ready='1']")
    row = page.locator(f"tr[data-session='{session_id}']").inner_text()
    assert "toy" in row and "active" in row, row
    finish = {"reason": {"type": "success"}}
    assert httpx.post(f"{url}/api/v1/sessions/{session_id}/finish", json=finish, headers=headers).status_code == 200
    page.reload()
    page.wait_for_selector("body[data-sessions-ready='1']")
    assert "closed" in page.locator(f"tr[data-session='{session_id}']").inner_text()
    page.screenshot(path=str(ARTIFACTS / "dashboard-sessions.png"), full_page=True)
