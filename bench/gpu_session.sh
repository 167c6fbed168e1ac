#!/usr/bin/env bash
# A lent GPU machine's checks in one run (docs/bench.md, "a lent H200"): the trainer-side benchmark and the step
# against TRL, both trainers generating with transformers (vLLM's CUDA wheels cannot travel to that machine).
# There: `bash bench/gpu_session.sh` (TRAINER_ARGS: more arguments of bench.gpu_trainer, e.g. --skip layouts;
# TRAINER_S / STEP_S: each part's time limit). Results go to $OUT. What the machine lacks travels as wheels in
# .whl (ignored by git, named in the run's carry), fetched here for its Python 3.12:
#   for p in pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
#            transformers==5.19.0 tokenizers==0.23.3 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19; do
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $p
#   done
set -u
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, transformers, trl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)"
} 2>&1 | tee "$OUT/machine.txt"
timeout "${TRAINER_S:-230}" python3 -m bench.gpu_trainer ${TRAINER_ARGS:-} --out "$OUT/gpu_trainer.json" 2>&1 | tee "$OUT/gpu_trainer.log"
timeout "${STEP_S:-230}" python3 -m bench.run --shape qwen0.5b --engine transformers --tokens 128 --steps 4 --runs 1 \
    --out "$OUT/run" 2>&1 | tee "$OUT/run.log"
