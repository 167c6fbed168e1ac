"""The dashboard: static pages (jobs list, job page, compare) that call the /v1 API from the browser."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent.parent / "static"

router = APIRouter(include_in_schema=False)


@router.get("/")
def jobs_page() -> FileResponse:
    return FileResponse(STATIC / "index.html")


@router.get("/jobs/{job_id}")
def job_page(job_id: str) -> FileResponse:
    return FileResponse(STATIC / "job.html")


@router.get("/compare")
def compare_page() -> FileResponse:
    return FileResponse(STATIC / "compare.html")


#: Mounted at /static by the app factory (vendored uPlot, the dashboard's JS and CSS; no CDN).
static_app = StaticFiles(directory=STATIC)
