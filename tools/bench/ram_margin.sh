#!/bin/bash
# ram_margin.py in a fresh cgroup-v1 memory cgroup of LIMIT_BYTES (root), file cache dropped first; prints its JSON
# line and the cgroup's max usage, failcnt and OOM kills.  Run from the repo root with the venv active:
#   bash tools/bench/ram_margin.sh 836009000 ~/.cache/glm-jax-bench/models/glm45air-L3-*/glm-jax-int4_g64-dense_auto 0.82 64
set -euo pipefail
CG=/sys/fs/cgroup/memory/glmjax_ram_margin$$
mkdir "$CG"
trap 'sleep 1; rmdir "$CG"' EXIT
echo "$1" > "$CG/memory.limit_in_bytes"
sync; echo 3 > /proc/sys/vm/drop_caches
( echo $BASHPID > "$CG/tasks"; exec python "$(dirname "$0")/ram_margin.py" "$2" "$3" "${4:-64}" ) 2>&1 \
  | grep -v "^glm-jax: building" | tail -3
echo "max_usage $(( $(cat "$CG/memory.max_usage_in_bytes") / 1000000 )) MB, failcnt $(cat "$CG/memory.failcnt"), $(grep oom_kill "$CG/memory.oom_control" | tr '\n' ' ')"
