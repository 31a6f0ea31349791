#!/usr/bin/env bash
# `python -m pisft bench --only device` (issue 54: the training step, the action chunk and the smoke
# gate's decisions, at most 6 minutes) on an offline GPU host: Python 3.12 with its own torch 2.11
# (and torchvision, numpy, pandas, pyarrow, safetensors, ...), no LeRobot, no package index.
#
# What it needs beside the checkout: .gpu-bundle/, built on a machine with the project's .venv by the
# team's bundle script (make-bundle.sh, kept with the GPU-host notes): .gpu-bundle/whl/ holds the
# packages the host lacks as wheels at the lock's versions (LeRobot, draccus, transformers,
# tokenizers, datasets, gymnasium, omegaconf, peft, ...; workflow/envs/cpu-cuda.lock.txt) and
# .gpu-bundle/site/ antlr4 and a stand-in for PyAV (LeRobot imports `av` at module level; nothing
# here decodes video). The wheels go to a folder of their own (PISFT_GPU_SITE, default
# /tmp/pisft-site), never into the host's Python.
#
# From the project root on the host (a lent device machine: the same command, with .gpu-bundle
# carried beside the working tree):
#   bash scripts/gpu-host-bench.sh                      # every job; results/bench/device.{json,md}
#   bash scripts/gpu-host-bench.sh --only gpu_step_all_off,smoke_gate   # some of them
# Arguments are python -m pisft.bench.device_bench's (--only, --timeout JOB=S, --budget-s, --out).
# Exit status: 0 every job ran, 1 some failed or timed out (device.md says which), 2 no accelerator.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if ! compgen -G ".gpu-bundle/whl/*.whl" > /dev/null; then
  echo "gpu-host-bench: no wheels in $root/.gpu-bundle/whl: build the bundle first (make-bundle.sh, on a" \
       "machine with the project's .venv) and bring .gpu-bundle/ beside this checkout" >&2
  exit 2
fi
python=${PYTHON:-python3}
"$python" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' 2>/dev/null || {
  echo "gpu-host-bench: $python is not Python 3.12 (the bundle's wheels are cp312); set PYTHON=" >&2; exit 2; }
site=${PISFT_GPU_SITE:-/tmp/pisft-site}
"$python" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .gpu-bundle/whl/*.whl
export PYTHONPATH="$root/src:$root/.gpu-bundle/site:$site" PYTHONUNBUFFERED=1
exec "$python" -m pisft.bench.device_bench --out results/bench "$@"
