#!/bin/bash
# long_prompts.py in a fresh memory cgroup of LIMIT_BYTES (in_cgroup.sh), killed after TIMEOUT_S (default 1800);
# prints its lines and the cgroup's max usage, failcnt and OOM kills.  Run from the repo root with the venv active:
#   bash tools/bench/long_prompts.sh 836009000 ~/.cache/glm-jax-bench/models/glm45air-L3-*/glm-jax-int4_g64-dense_auto
set -euo pipefail
here=$(dirname "$0")
exec bash "$here/in_cgroup.sh" "$1" timeout "${3:-1800}" python "$here/long_prompts.py" "$2"
