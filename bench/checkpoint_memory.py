"""Host memory of one checkpoint save, phase by phase: ``python -m bench.checkpoint_memory [--shape qwen0.5b]``.

A model of ``--shape`` (random init, on the GPU when there is one) takes one AdamW step, so the optimizer holds
its moments; then the three writes of `gspo_core.checkpoint.save_checkpoint` run one at a time (the DCP trainer
state, the gathered HF export, ``trainer_state.pt``), each reporting how far it raised this process's resident
memory above where it started (the peak, reset before each through ``/proc/self/clear_refs``) and what it left.
``--as-before``: the files as they were written before their host-memory bounds (one DCP file a rank, one export
file).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.gpu_trainer import make_model
from gspo_core import distributed, policy
from gspo_core.checkpoint import rng_state
from gspo_core.distributed import LeadWriter, gather_state_dict, save_sharded
from gspo_core.toy import build_tokenizer


def _status(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def measured(fn) -> dict[str, float]:
    """``fn()``'s rise of the peak resident memory over the resident memory before it, and what it left, in MB."""
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
    before, t0 = _status("VmRSS"), time.perf_counter()
    fn()
    return {
        "peak_rise_mb": _status("VmHWM") - before,
        "left_mb": _status("VmRSS") - before,
        "s": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.checkpoint_memory")
    ap.add_argument("--shape", default="qwen0.5b")
    ap.add_argument("--out", default=None)
    ap.add_argument("--as-before", action="store_true", help="one DCP file a rank and one export file (2026-11-28)")
    a = ap.parse_args(argv)
    if a.as_before:
        distributed.DCP_HOLDS_FILE_COPIES, policy.EXPORT_SHARD_SIZE = False, "50GB"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = make_model(a.shape, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    ids = torch.randint(3, model.config.vocab_size, (2, 64), device=device)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    params = sum(p.numel() for p in model.parameters())
    res: dict = {
        "device": str(device),
        "as_before": a.as_before,
        "shape": a.shape,
        "params": params,
        "fp32_weights_mb": params * 4 / 2**20,
    }
    writer = LeadWriter()
    with tempfile.TemporaryDirectory() as tmp:
        tok = build_tokenizer(str(Path(tmp) / "tok"), model.config.vocab_size)
        res["rss_start_mb"] = _status("VmRSS")
        res["dcp_trainer_state"] = measured(lambda: save_sharded(model, optimizer, Path(tmp) / "trainer"))
        res["hf_export"] = measured(lambda: writer.export(model, tok, Path(tmp) / "model", gather_state_dict(model)))
        res["trainer_state_pt"] = measured(lambda: writer.save({"rng": rng_state()}, Path(tmp) / "state.pt"))
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
