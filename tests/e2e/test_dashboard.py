"""The dashboard in real headless Chromium (Debian's) over a real service running a real tiny job."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.api.test_openai_sdk import chat_rows
from tests.conftest import spawn_logged

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium not installed"),
]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """Embedded default: SQLite, local objects, filesystem broker, a real worker subprocess, uvicorn."""
    import uvicorn

    from api.app import create_app
    from gspo_client import Client
    from gspo_core.toy import TOY_REWARD, build_tiny_model, write_toy_dataset
    from store.db import run_migrations
    from store.settings import Settings
    from store.tenants import create_tenant_and_key

    tmp = tmp_path_factory.mktemp("dash")
    env_vals = {
        "GSPO_DATA_DIR": str(tmp),
        "GSPO_MODELS_DIR": str(tmp / "models"),
        "GSPO_ROLLOUT_ENGINE": "transformers",
    }
    settings = Settings(data_dir=tmp, models_dir=tmp / "models")
    run_migrations(settings.resolved_database_url())
    build_tiny_model(settings.models_dir / "toy")
    env = {**os.environ, **env_vals, "PYTHONPATH": str(ROOT)}
    worker = spawn_logged(
        [sys.executable, "-m", "gspo_cli.main", "worker", "--loglevel", "WARNING"],
        tmp / "worker.log",
        env=env,
        cwd=ROOT,
    )
    app = create_app(settings)
    with app.state.db.session() as s:
        _, key = create_tenant_and_key(s, "dash")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with Client(url, key) as c:
        f = c.upload_file(write_toy_dataset(tmp / "toy.jsonl", n=32))
        job = c.create_job(
            model="toy",
            training_file=f["id"],
            reward=TOY_REWARD,
            name="dashboard-demo",
            hyperparameters={
                "steps": 12,
                "prompts_per_step": 4,
                "group_size": 8,
                "max_new_tokens": 4,
                "learning_rate": 3e-3,
                "save_every": 6,
            },
        )
        second = c.create_job(
            model="toy",
            training_file=f["id"],
            reward=TOY_REWARD,
            name="second",
            hyperparameters={"steps": 4, "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 4},
        )
        chat = tmp / "chat.jsonl"
        chat.write_text("".join(json.dumps(r) + "\n" for r in chat_rows("abcdabcd")))
        sft = c.create_job(
            model="toy",
            training_file=c.upload_file(chat)["id"],
            name="supervised",
            hyperparameters={"method": "supervised", "steps": 4, "prompts_per_step": 4, "learning_rate": 3e-3},
        )
        for j in (job, second, sft):
            for _ in c.events(j["id"]):
                pass
        for j in (job, sft):
            assert c.get_job(j["id"])["status"] == "succeeded", (tmp / "worker.log").read_text()[-3000:]
    yield url, key, job["id"], second["id"], sft["id"]
    server.should_exit = True
    th.join(10)
    worker.terminate()
    worker.wait(30)


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
def page(browser, service):
    url, key, *_ = service
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


def test_jobs_list(page, service):
    url, _, job_id, _, sft_id = service
    ARTIFACTS.mkdir(exist_ok=True)
    page.goto(url + "/")
    page.wait_for_selector("body[data-jobs-ready='1']")
    row = page.locator(f"tr[data-job='{job_id}']")
    assert "succeeded" in row.inner_text() and "12/12" in row.inner_text()
    assert row.locator("svg.spark polyline").count() == 1
    sft = page.locator(f"tr[data-job='{sft_id}']")  # a supervised job shows its loss
    assert "4/4" in sft.inner_text() and " loss" in sft.inner_text() and sft.locator("svg.spark").count() == 1
    page.screenshot(path=str(ARTIFACTS / "dashboard-jobs.png"), full_page=True)


def test_job_page_charts_inspector_and_download(page, service):
    url, _, job_id, *_ = service
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


def test_supervised_job_page(page, service):
    """A supervised job (either API) shows its loss and none of the reinforcement charts."""
    url, *_, sft_id = service
    page.goto(f"{url}/jobs/{sft_id}")
    page.wait_for_selector("body[data-charts-ready='1']")
    loss = page.locator("#chart-loss")
    assert loss.is_visible() and loss.get_attribute("data-points") == "4"
    assert colours(loss.locator("canvas").screenshot()) > 10
    for chart in ("reward", "clip", "ratio", "time"):
        assert page.locator(f"#chart-{chart}").is_hidden(), chart
    assert page.locator("#ckpt-metric").text_content() == "Loss"
    assert page.locator("#checkpoints a.download").count() >= 1


def test_compare_page(page, service):
    url, _, job_id, second, _ = service
    page.goto(f"{url}/compare?jobs={job_id},{second}")
    page.wait_for_selector("body[data-compare-ready='2']")
    assert colours(page.locator("#compare-chart canvas").screenshot()) > 10
    page.screenshot(path=str(ARTIFACTS / "dashboard-compare.png"), full_page=True)
