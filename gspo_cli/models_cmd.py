"""`gspo models import PATH`: a GGUF file or a Hugging Face directory made a trainable model of the models directory."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict
from pathlib import Path

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def default_name(source: Path) -> str:
    """``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``: the stem up to its quantization tag."""
    stem = source.name if source.is_dir() else source.stem
    return stem.split(".")[0] if source.suffix == ".gguf" else stem


def run_import(args) -> int:
    from gspo_core.model_import import ModelImportError, import_model

    if args.models_dir:
        models_dir = Path(args.models_dir)
    else:
        from store.settings import get_settings

        models_dir = get_settings().models_dir
    source = Path(args.path).expanduser().resolve()
    name = args.name or default_name(source)
    if not _NAME.fullmatch(name):
        print(f"--name: {name!r} is not a model name (letters, digits, '.', '_', '-')", file=sys.stderr)
        return 2
    try:
        tolerance = {} if args.tolerance is None else {"tolerance": args.tolerance}
        report = import_model(source, models_dir / name, **tolerance)
    except ModelImportError as exc:
        print(f"gspo models import: {exc}", file=sys.stderr)
        return 1
    out = {**asdict(report), "path": str(report.path), "model": name}
    print(json.dumps(out, indent=2))
    return 0


def register(sub) -> None:
    # Nothing of gspo_core here: every `gspo` command builds this parser, and the importer brings torch (2 s).
    models = sub.add_parser("models", help="manage the models directory that jobs name models from")
    models_sub = models.add_subparsers(dest="models_command", metavar="SUBCOMMAND", required=True)
    p = models_sub.add_parser(
        "import",
        help="turn a GGUF file or a Hugging Face directory into a trainable model (fp32 safetensors)",
    )
    p.add_argument("path", help="a .gguf file (dequantized by transformers) or a Hugging Face model directory")
    p.add_argument("--name", help="the model's name in the models directory (default: the file's stem)")
    p.add_argument("--models-dir", help="where to write it (default: the service's GSPO_MODELS_DIR)")
    p.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="largest |logit| difference accepted between the source and the saved model (default: the "
        "importer's, gspo_core.model_import.DEFAULT_TOLERANCE)",
    )
    p.set_defaults(func=run_import)
