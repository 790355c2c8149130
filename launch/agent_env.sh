#!/usr/bin/env bash
# A virtual environment of its own for agent code whose packages conflict with ours; a run names
# its interpreter in task.agent_python (docs/bring-your-environment.md):
#   bash launch/agent_env.sh openenv     -> .venv-openenv/bin/python (openenv-core; gradio pins pillow < 13)
#   bash launch/agent_env.sh verifiers   -> .venv-verifiers/bin/python (verifiers; openai < 3, mcp 2.0.0)
#   bash launch/agent_env.sh tinker      -> .venv-tinker/bin/python (tinker-cookbook 0.6.1, a client of
#        launch.serve: it asks for tml-renderers >= 0.4.1, which no index has; 0.2.1 runs its recipes)
# Arguments after KIND are more packages for it, pip's way (a folder, a wheel, name==version): an
# environment's own package, e.g. bash launch/agent_env.sh verifiers examples/verifiers_sum
# Made from the same Python as .venv (launch/install.sh first): the episodes run a standard-library
# part of this checkout there.
set -euo pipefail
cd "$(dirname "$0")/.."
kind="${1:-}"
shift || true
case "$kind" in
  openenv) pins="openenv-core==0.3.0 openai==3.57.0" ;;
  verifiers) pins="verifiers==0.4.0" ;;
  # the cookbook's own requirements as its wheel lists them, torch and transformers as .venv has them
  tinker) pins="tinker==0.38.0 tml-renderers==0.2.1 torch==2.13.0 transformers==5.19.0 aiohttp anyio blobfile chz
                cloudpickle datasets huggingface-hub numpy pillow pydantic pyrage rich safetensors termcolor tiktoken
                tqdm math-verify pylatexenc sympy"
          nodeps="tinker-cookbook==0.6.1" ;;
  *) echo "error: bash launch/agent_env.sh KIND: KIND is openenv, verifiers or tinker (got '$kind')" >&2; exit 2 ;;
esac
[ -x .venv/bin/python ] || { echo "error: .venv is missing: run bash launch/install.sh first" >&2; exit 2; }
venv=".venv-$kind"
stamp="$venv/.installed-$(echo "$pins ${nodeps:-}" | sha1sum | cut -c1-12)"
if [ -f "$stamp" ]; then
  echo "$venv is up to date ($pins)"
else
  rm -rf "$venv"
  .venv/bin/python -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install -q $pins
  if [ -n "${nodeps:-}" ]; then
    # shellcheck disable=SC2086
    "$venv/bin/python" -m pip install -q --no-deps $nodeps
  fi
  touch "$stamp"
  echo "Installed $pins into $(cd "$venv" && pwd)"
fi
if [ "$#" -gt 0 ]; then  # reinstalled each time: a local folder may have changed
  "$venv/bin/python" -m pip install -q --no-deps --force-reinstall "$@"
  "$venv/bin/python" -m pip check -q >/dev/null || { "$venv/bin/python" -m pip check >&2; exit 2; }
  echo "Installed $* into $venv"
fi
echo "task.agent_python=$(cd "$venv" && pwd)/bin/python"
