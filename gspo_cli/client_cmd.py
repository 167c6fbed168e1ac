"""`gspo files|jobs|checkpoints ...`: the API client from the shell (GSPO_BASE_URL / GSPO_API_KEY)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import yaml

from gspo_client import ApiError, Client


def _client(args) -> Client:
    base = args.base_url or os.environ.get("GSPO_BASE_URL", "http://127.0.0.1:8000")
    key = args.api_key or os.environ.get("GSPO_API_KEY")
    if not key:
        raise ApiError(0, "no_api_key", "set GSPO_API_KEY or pass --api-key")
    return Client(base, key)


def _print(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


def files_upload(c: Client, args):
    _print(c.upload_file(args.path))


def files_list(c: Client, args):
    for f in c.list_files():
        print(f"{f['id']}  {f['rows']:>7} rows  {f['bytes']:>10} B  {f['filename']}")


def jobs_create(c: Client, args):
    from gspo_core.cli import parse_set

    body = yaml.safe_load(Path(args.file).read_text()) if args.file else {}
    for key in ("model", "training_file", "validation_file", "name"):
        if getattr(args, key):
            body[key] = getattr(args, key)
    for key in ("reward", "environment"):
        if value := getattr(args, key):
            body[key] = json.loads(Path(value).read_text()) if Path(value).exists() else json.loads(value)
    body["hyperparameters"] = {**(body.get("hyperparameters") or {}), **parse_set(args.set)}
    supervised = body["hyperparameters"].get("method") == "supervised"  # trains on chat rows, no grader
    # An environment brings its prompts and (unless a reward is given) its own scoring.
    needed = ("model",) if body.get("environment") else ("model", "training_file", *(() if supervised else ("reward",)))
    missing = [k for k in needed if not body.get(k)]
    if missing:
        raise ApiError(0, "invalid_arguments", f"missing {', '.join(missing)} (flags or the job file)", missing[0])
    _print(c.create_job(**body, idempotency_key=args.idempotency_key))


def jobs_list(c: Client, args):
    for j in c.list_jobs(status=args.status, limit=args.limit)["data"]:
        reward = (j["latest_metrics"] or {}).get("reward/mean")
        print(
            f"{j['id']}  {j['status']:<10} {j['step']:>5}/{j['total_steps']:<5} "
            f"reward={'-' if reward is None else f'{reward:.3f}'}  {j['name'] or ''}"
        )


def jobs_get(c: Client, args):
    _print(c.get_job(args.job_id))


def jobs_cancel(c: Client, args):
    print(c.cancel_job(args.job_id)["status"])


def jobs_pause(c: Client, args):
    print(c.pause_job(args.job_id)["status"])


def jobs_resume(c: Client, args):
    print(c.resume_job(args.job_id)["status"])


def jobs_delete(c: Client, args):
    c.delete_job(args.job_id)
    print("deleted")


def jobs_metrics(c: Client, args):
    if args.csv:
        sys.stdout.write(c.metrics_csv(args.job_id))
    else:
        _print(c.metrics(args.job_id))


def jobs_watch(c: Client, args):
    """A live progress bar (step, reward, ETA) from the event stream, then a summary."""
    from tqdm import tqdm

    job = c.get_job(args.job_id)
    rewards: list[float] = []
    with tqdm(total=job["total_steps"], initial=0, unit="step", desc=args.job_id[:16]) as bar:
        for event, data, _ in c.events(args.job_id):
            if event == "metrics" and data["step"] > 0:  # step 0: the held-out evaluation before training
                rewards.append(data["metrics"].get("reward/mean", 0.0))
                bar.n = data["step"]
                bar.set_postfix(reward=f"{rewards[-1]:.3f}")
                bar.refresh()
            elif event in ("status", "checkpoint"):
                bar.write(f"[{event}] {data['message']}")
    job = c.get_job(args.job_id)
    summary = f"{job['id']}: {job['status']} at step {job['step']}/{job['total_steps']}"
    if rewards:
        summary += f"; reward {rewards[0]:.3f} -> {rewards[-1]:.3f} (best {max(rewards):.3f})"
    if held_out := evaluation_line(job.get("evaluation") or {}):
        summary += f"; held-out {held_out}"
    print(summary + (f"; error: {job['error']}" if job["error"] else ""))
    return 0 if job["status"] == "succeeded" else 1


def evaluation_line(evaluation: dict) -> str:
    """``greedy 0.220 -> 0.410, sampled 0.190 -> 0.350`` of a job's held-out evaluation (empty: none yet)."""
    before, after = evaluation.get("before") or {}, evaluation.get("after") or {}
    parts = []
    for key, label in (("greedy_reward", "greedy"), ("sampled_reward", "sampled"), ("loss", "loss")):
        if before.get(key) is not None or after.get(key) is not None:
            was, now = before.get(key), after.get(key)
            parts.append(f"{label} {'-' if was is None else f'{was:.3f}'} -> {'...' if now is None else f'{now:.3f}'}")
    return ", ".join(parts)


def ckpt_list(c: Client, args):
    before = (c.get_job(args.job_id).get("evaluation") or {}).get("before") or {}
    for k in c.list_checkpoints(args.job_id):
        metrics = k["metrics"]
        held_out = ""
        if (now := metrics.get("eval/greedy/reward/mean")) is not None:  # before -> this checkpoint's step
            was = before.get("greedy_reward")
            held_out = f"  held-out greedy {'' if was is None else f'{was:.3f} -> '}{now:.3f}"
        print(
            f"{k['id']}  step {k['step']:>6}  {k['size_bytes'] / 1e6:8.2f} MB  "
            f"reward={metrics.get('reward/mean', float('nan')):.3f}{held_out}{'  final' if k['final'] else ''}"
        )


def ckpt_download(c: Client, args):
    from tqdm import tqdm

    dest = Path(args.output or f"{args.checkpoint_id}.tar.gz")
    with tqdm(unit="B", unit_scale=True, desc="download") as bar:
        c.download_checkpoint(args.checkpoint_id, dest, progress=bar.update)
    print(f"saved {dest} ({dest.stat().st_size} bytes, verified)")


def _wrap(fn):
    def run(args) -> int:
        try:
            with _client(args) as c:
                return int(fn(c, args) or 0)
        except ApiError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except OSError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1

    return run


def _common(p) -> None:
    p.add_argument("--base-url", help="default $GSPO_BASE_URL or http://127.0.0.1:8000")
    p.add_argument("--api-key", help="default $GSPO_API_KEY")


def register(sub) -> None:
    def cmd(group, name, fn, help_):
        p = group.add_parser(name, help=help_)
        _common(p)
        p.set_defaults(func=_wrap(fn))
        return p

    files = sub.add_parser("files", help="datasets").add_subparsers(dest="files_command", required=True)
    cmd(files, "upload", files_upload, "upload a JSONL dataset").add_argument("path")
    cmd(files, "list", files_list, "list datasets")
    jobs = sub.add_parser("jobs", help="training jobs").add_subparsers(dest="jobs_command", required=True)
    p = cmd(jobs, "create", jobs_create, "create a job from flags and/or a YAML/JSON file")
    p.add_argument("file", nargs="?", help="YAML/JSON with the job's fields")
    for flag in ("model", "training-file", "validation-file", "name", "idempotency-key"):
        p.add_argument(f"--{flag}")
    p.add_argument("--reward", help="grader spec JSON, or a path to one")
    p.add_argument("--environment", help="environment JSON instead of a training file, or a path to one")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a hyperparameter")
    p = cmd(jobs, "list", jobs_list, "list jobs")
    p.add_argument("--status")
    p.add_argument("--limit", type=int, default=50)
    for name, fn, help_ in (
        ("get", jobs_get, "show a job"),
        ("cancel", jobs_cancel, "cancel a job"),
        ("pause", jobs_pause, "pause a job (a running one checkpoints at its next step and stops)"),
        ("resume", jobs_resume, "resume a paused job from its checkpoint"),
        ("delete", jobs_delete, "delete a finished job and everything it made"),
        ("watch", jobs_watch, "follow a job live"),
    ):
        cmd(jobs, name, fn, help_).add_argument("job_id")
    p = cmd(jobs, "metrics", jobs_metrics, "a job's step metrics")
    p.add_argument("job_id")
    p.add_argument("--csv", action="store_true")
    ck = sub.add_parser("checkpoints", help="checkpoints").add_subparsers(dest="ckpt_command", required=True)
    cmd(ck, "list", ckpt_list, "a job's checkpoints").add_argument("job_id")
    p = cmd(ck, "download", ckpt_download, "download a checkpoint archive (verified)")
    p.add_argument("checkpoint_id")
    p.add_argument("-o", "--output")
