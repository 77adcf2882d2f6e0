#!/bin/bash
# ram_margin.py in a fresh memory cgroup of LIMIT_BYTES (in_cgroup.sh); prints its JSON line and the cgroup's max
# usage, failcnt and OOM kills.  Run from the repo root with the venv active:
#   bash tools/bench/ram_margin.sh 836009000 ~/.cache/glm-jax-bench/models/glm45air-L3-*/glm-jax-int4_g64-dense_auto 0.82 64
set -euo pipefail
here=$(dirname "$0")
bash "$here/in_cgroup.sh" "$1" python "$here/ram_margin.py" "$2" "$3" "${4:-64}" | tail -4
