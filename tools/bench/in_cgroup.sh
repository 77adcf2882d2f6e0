#!/bin/bash
# CMD... in a fresh cgroup-v1 memory cgroup of LIMIT_BYTES (root), file cache dropped first; its output without the
# kernel-build line, then the cgroup's max usage, failcnt and OOM kills.  What ram_margin.sh and long_prompts.sh run:
#   bash tools/bench/in_cgroup.sh LIMIT_BYTES CMD...
set -euo pipefail
limit=$1; shift
CG=/sys/fs/cgroup/memory/glmjax_bench$$
mkdir "$CG"
trap 'sleep 1; rmdir "$CG"' EXIT
echo "$limit" > "$CG/memory.limit_in_bytes"
sync; echo 3 > /proc/sys/vm/drop_caches
( echo $BASHPID > "$CG/tasks"; exec "$@" ) 2>&1 | grep --line-buffered -v "^glm-jax: building" || true
echo "max_usage $(( $(cat "$CG/memory.max_usage_in_bytes") / 1000000 )) MB, failcnt $(cat "$CG/memory.failcnt"), $(grep oom_kill "$CG/memory.oom_control" | tr '\n' ' ')"
