#!/usr/bin/env bash
# The accelerator check (never in CI): golden parity tests + peer-free benches on whatever device jax sees, one
# table, in under 5 minutes.  Run from the repo root in an environment where jax sees the accelerator and glm-jax
# and its test extra are installed (a machine without network needs them installed beforehand), e.g.
#   python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]' 'jax[cuda12]' && tools/device_check.sh
# On a CPU-only machine it runs the same rows on the CPU (how it was tested: 85 s on 2 cores).  The native kernels
# are CPU kernels: on an accelerator --kernels=auto runs the XLA path (the table says which kernels ran).
#   tools/device_check.sh [extra args for python -m tools.bench.device_check, e.g. --budget_s=150]
# Without an install (a lent machine whose image has jax, flax and pytest but no network, so no `pip install -e`):
#   PATH=/opt/torch/.venv/bin:$PATH tools/device_check.sh      (the nvidia-h200 image's Python; docs/device.md)
# runs from the checkout: the repo root on PYTHONPATH and plugins/ under its installed name, glm_jax_plugins.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
if ! python -c "import glm_jax_plugins" 2>/dev/null; then
  site=$(mktemp -d /tmp/glm-jax-site.XXXXXX)
  ln -s "$PWD/plugins" "$site/glm_jax_plugins"
  export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
fi
log=$(mktemp /tmp/glm-jax-parity.XXXXXX.log)
python -c "import jax; print('devices:', jax.devices())"
# golden parity against transformers' numbers: f32 matmuls at full precision (a GPU's default may round f32 dot
# products through TF32, which is not what the 1e-4 parity bound is about)
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 150 python -m pytest -q -p no:cacheprovider \
  tests/test_engine_golden.py tests/test_mla.py -k "transformers or oracle or golden or greedy" 2>&1 | tee "$log" | tail -n 5
python -m tools.bench.device_check --parity_log="$log" "$@"
rc=$?
echo "device_check: $(( $(date +%s) - start )) s wall"
exit $rc
