#!/bin/bash
# long_prompts.py in a fresh cgroup-v1 memory cgroup of LIMIT_BYTES (root), file cache dropped first; prints its
# lines and the cgroup's max usage, failcnt and OOM kills.  Run from the repo root with the venv active:
#   bash tools/bench/long_prompts.sh 836009000 ~/.cache/glm-jax-bench/models/glm45air-L3-*/glm-jax-int4_g64-dense_auto
set -euo pipefail
CG=/sys/fs/cgroup/memory/glmjax_long_prompts$$
mkdir "$CG"
trap 'sleep 1; rmdir "$CG"' EXIT
echo "$1" > "$CG/memory.limit_in_bytes"
sync; echo 3 > /proc/sys/vm/drop_caches
( echo $BASHPID > "$CG/tasks"; exec timeout "${3:-1800}" python "$(dirname "$0")/long_prompts.py" "$2" ) 2>&1 \
  | grep --line-buffered -v "^glm-jax: building" || true
echo "max_usage $(( $(cat "$CG/memory.max_usage_in_bytes") / 1000000 )) MB, failcnt $(cat "$CG/memory.failcnt"), $(grep oom_kill "$CG/memory.oom_control" | tr '\n' ' ')"
