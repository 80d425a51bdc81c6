#!/usr/bin/env bash
# The README's test command: formatting, lints, the peer scripts' self-tests, then every test of the workspace (no GPU needed;
# GPU and NVRTC tests are #[ignore]d and listed as such: scripts/gpu-suite.sh runs them on a GPU).
# Extra arguments go to `cargo test` (e.g. `scripts/test.sh -p kairos-sched`).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== cargo fmt --check"
cargo fmt --all --check
echo "== cargo clippy (warnings are errors)"
cargo clippy --workspace --all-targets --quiet -- -D warnings
echo "== peer scripts' self-tests (no torch, no GPU)"
python3 scripts/cold_serve_peer.py --self-test
python3 scripts/test_krisp_table.py
python3 scripts/test_onnx_kernel_table.py
echo "== cargo test"
if [ $# -gt 0 ]; then
    cargo test "$@"
else
    cargo test --workspace
fi
