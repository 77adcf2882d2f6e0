"""Developer tools (not installed): benchmarks (tools/bench/) and fixture generators (tools/fixtures/); run from the repo root with ``python -m tools.bench ...``."""
