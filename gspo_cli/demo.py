"""`gspo demo`: the embedded service end to end — upload, train a tiny model, watch it learn, download."""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path


def _serve(port: int, log_level: str):
    import uvicorn

    from api.app import create_app
    from store.settings import get_settings

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    server = uvicorn.Server(uvicorn.Config(create_app(get_settings()), log_level=log_level))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.05)
    return server, th, f"http://127.0.0.1:{sock.getsockname()[1]}"


def _watch(client, job_id: str, total: int) -> list[float]:
    from tqdm import tqdm

    rewards: list[float] = []
    with tqdm(total=total, unit="step", desc="training") as bar:
        for event, data, _ in client.events(job_id):
            if event == "metrics":
                rewards.append(data["metrics"]["reward/mean"])
                bar.n = data["step"]
                bar.set_postfix(reward=f"{rewards[-1]:.3f}")
            elif event in ("status", "log", "checkpoint"):
                bar.write(f"[{event}] {data['message']}")
    return rewards


def run_demo(args) -> int:
    from gspo_cli import logs

    level = logs.level_of(args.verbose)
    logs.configure(level)  # before the libraries below load

    from gspo_cli.service_cmd import create_key, migrate, start_worker, stop_worker
    from gspo_client import Client
    from gspo_core.toy import TOY_REWARD, build_tiny_model, write_toy_dataset
    from store.settings import get_settings

    settings = get_settings()
    migrate()
    model_dir = build_tiny_model(settings.models_dir / "toy-demo", shape="toy")
    data = write_toy_dataset(settings.data_dir / "demo" / "toy.jsonl", n=64)
    worker = start_worker(logging.getLevelName(level), rollout_engine=args.engine)
    server, th, url = _serve(args.port, logs.uvicorn_level(level))
    try:
        with Client(url, create_key("demo")) as client:
            print(f"service up at {url} (dashboard: {url}/)")
            f = client.upload_file(data)
            job = client.create_job(
                model=model_dir.name,
                training_file=f["id"],
                reward=TOY_REWARD,
                name="demo",
                hyperparameters={
                    "steps": args.steps,
                    "prompts_per_step": 8,
                    "group_size": 8,
                    "max_new_tokens": 4,
                    "learning_rate": 3e-3,
                    "save_every": 20,
                },
            )
            print(f"job {job['id']} queued; dashboard: {url}/jobs/{job['id']}")
            rewards = _watch(client, job["id"], args.steps)
            job = client.get_job(job["id"])
            if job["status"] != "succeeded":
                print(f"job ended {job['status']}: {job['error']}")
                return 1
            k = max(1, len(rewards) // 5)
            print(
                f"mean reward: first {k} steps {sum(rewards[:k]) / k:.3f} -> last {k} steps {sum(rewards[-k:]) / k:.3f}"
            )
            return _download_and_load(client, job["id"], settings.data_dir / "demo")
    finally:
        server.should_exit = True
        th.join(10)
        stop_worker(worker)


def _download_and_load(client, job_id: str, out: Path) -> int:
    import tarfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = client.list_checkpoints(job_id)[-1]
    archive = client.download_checkpoint(ckpt["id"], out / f"{ckpt['id']}.tar.gz")
    dest = out / "checkpoint" / ckpt["id"]  # one directory per checkpoint: a rerun never loads an older one
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    model_dir = next(dest.glob("*/model"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = tok("say c:", return_tensors="pt", add_special_tokens=False)
    gen = model.generate(**ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    answer = tok.decode(gen[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    print(f"downloaded {archive} ({archive.stat().st_size} bytes), loaded with transformers from {model_dir}")
    print(f"the trained model answers 'say c:' with {answer!r}")
    return 0
