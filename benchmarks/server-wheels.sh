#!/usr/bin/env bash
# Prepare ./.device/server-wheels (git-ignored): the wheels ComfyUI's server (main.py) imports that the offline GPU
# machine's Python 3.12 lacks, for the `server` step of benchmarks/gpu_run.sh (benchmarks/real_server.py). Its image
# already has aiohttp, yarl, multidict, Jinja2, MarkupSafe, PyYAML, requests and the rest of ComfyUI's needs; .whl/
# (../shared/tools/device-wheels.sh) carries comfy-kitchen, comfy-aimdo, torchsde and trampoline, .device/av_stub
# stands in for PyAV. The frontend package is not needed: the step serves a one-page stand-in through ComfyUI's own
# --front-end-root. Versions: those the test environment runs ComfyUI's server with (tests/requirements-test.txt
# resolves them); typing_extensions because this pydantic needs 4.16 or newer.
# Usage (from the repository root): bash benchmarks/server-wheels.sh      (about 6 MB; carry .device)
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
dest=.device/server-wheels
rm -rf "$dest" && mkdir -p "$dest"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest" \
  SQLAlchemy==2.1.9 alembic==1.20.1 Mako==1.4.3 blake3==1.0.11 simpleeval==1.0.8 \
  pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 annotated-types==0.8.0 typing-inspection==0.4.5 \
  python-dotenv==1.2.4 typing_extensions==4.16.0
ls -la "$dest"
du -sh "$dest"
