#!/usr/bin/env bash
# Makes the ONNX exporter corpus (scripts/onnx_corpus.py) with pinned CPU PyTorch and friends from
# the package registry, in a virtual environment of its own.
#
#   scripts/onnx-corpus.sh [OUT] [onnx_corpus.py arguments...]   (default OUT: target/onnx-corpus, tiny tier)
#   kairos check-onnx OUT                                         (then: every export against onnxruntime)
#
# Environment: CORPUS_VENV (default target/onnx-corpus-venv), CORPUS_KEEP_VENV=1 keeps it
# afterwards (PyTorch's wheels take ~6 GB; CI removes them before building), CORPUS_PYTHON (a
# Python that already has the packages: no venv, no install; the GPU machine's own PyTorch).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-target/onnx-corpus}"
shift || true
# The versions CI generates with: an exporter release that writes new ops changes the corpus.
packages=(torch==2.15.0 torchvision==0.29.2 timm==1.0.31 transformers==5.24.0 onnx==1.23.2 onnxscript==0.7.2
    onnxruntime==1.32.0 numpy)
if [[ -n "${CORPUS_PYTHON:-}" ]]; then
    python="$CORPUS_PYTHON"
else
    venv="${CORPUS_VENV:-target/onnx-corpus-venv}"
    if [[ ! -x "$venv/bin/python" ]]; then
        echo "onnx-corpus: installing ${packages[*]} into $venv (a few minutes, ~6 GB)" >&2
        python3 -m venv "$venv"
        "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir "${packages[@]}"
    fi
    python="$venv/bin/python"
fi
mkdir -p "$out"
started=$(date +%s)
# Progress lines to the terminal; the exporters' own chatter (warnings, the version converter's
# tracebacks for opsets it leaves as they are) to $out/generate.log.
set +o pipefail
"$python" scripts/onnx_corpus.py --out "$out" --opsets 17,18,newest "$@" 2> "$out/generate.log" |
    grep --line-buffered -E '^\[[0-9]+\]|written'
status=${PIPESTATUS[0]}
set -o pipefail
if [[ $status != 0 || ! -s "$out/manifest.json" ]]; then
    tail -30 "$out/generate.log" >&2
    echo "onnx-corpus: the generator failed (exit $status); its log: $out/generate.log" >&2
    exit 1
fi
echo "onnx-corpus: $out in $(($(date +%s) - started)) s" >&2
# The onnxruntime peer script (scripts/ort_cuda_peer.py, the GPU machine's onnxruntime CUDA
# provider column) run end to end on a few exports with the CPU provider: fp16 conversion, fixed
# shapes, the transformer optimizer, IO binding. A check of the script, not a peer number.
"$python" scripts/ort_cuda_peer.py "$out" --device cpu --reps 3 --only '^(resnet18|distilbert|gpt2)$' \
    --require-all --out "$out/ort-peer-cpu-check.json" >"$out/ort-peer-cpu-check.log" 2>&1 || {
    tail -20 "$out/ort-peer-cpu-check.log" >&2
    echo "onnx-corpus: scripts/ort_cuda_peer.py failed on the CPU provider; its log: $out/ort-peer-cpu-check.log" >&2
    exit 1
}
echo "onnx-corpus: $(tail -1 "$out/ort-peer-cpu-check.log")" >&2
if [[ -z "${CORPUS_PYTHON:-}" && "${CORPUS_KEEP_VENV:-0}" != 1 ]]; then
    rm -rf "$venv"
fi
