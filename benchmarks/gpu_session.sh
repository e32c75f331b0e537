#!/usr/bin/env bash
# One stage of an H200 verification session, sized to fit one device call (< 10 min each):
#
#   bash benchmarks/gpu_session.sh tests    # the whole `gpu`-marked suite
#   bash benchmarks/gpu_session.sh encode   # ModernBERT + DeBERTa inference benchmarks (with peers)
#   bash benchmarks/gpu_session.sh train    # training step benchmark (with DisentangledFlash)
#   bash benchmarks/gpu_session.sh graph    # graph transformer benchmark
#   bash benchmarks/gpu_session.sh deberta  # DeBERTa kernel variants and band split, step profile, DeBERTa-only training step
#
# Run from the repository root (or a `git archive` snapshot of it). Logs and result files go to
# $OUT (default ./gpu_out); copy the JSON / PNG into benchmarks/results/ afterwards. Peer wheels
# (DisentangledFlash, FlashDeBERTa, einops) are installed from ./.whl when that folder exists:
#   python3 -m pip download --no-deps -d .whl disentangled-flash==1.1.1 flashdeberta==0.0.8 einops==0.8.2
# Set GIT_COMMIT to the snapshot's commit so the records name it.
set -uo pipefail
stage=${1:?usage: gpu_session.sh tests|encode|train|graph|deberta}
out=${OUT:-gpu_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/peer-site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/peer-site"
fi
case "$stage" in
    tests)
        timeout 560 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 tests 2>&1 | tee "$out/tests.log" | tail -40 ;;
    encode)
        timeout 250 python3 -m benchmarks.encode --model modernbert-base --out-dir "$out" 2>&1 | tee "$out/modernbert.log" | tail -12
        timeout 250 python3 -m benchmarks.encode --model deberta-v3-base --out-dir "$out" 2>&1 | tee "$out/deberta.log" | tail -30 ;;
    train)
        timeout 560 python3 -m benchmarks.train --out-dir "$out" 2>&1 | tee "$out/train.log" | tail -40 ;;
    deberta)
        timeout 180 python3 -m benchmarks.profile_gpu --parts kernel 2>&1 | tee "$out/deberta_kernel.log" | grep -E "^(case|doc1k|long)|failed"
        timeout 60 python3 -m benchmarks.deberta_band_split 2>&1 | tee "$out/deberta_band_split.log" | tail -40
        timeout 100 python3 -m benchmarks.profile_gpu --parts train --models deberta-v3-base > "$out/deberta_train_profile.log" 2>&1
        timeout 250 python3 -m benchmarks.train --models deberta-v3-base --out-dir "$out" 2>&1 | tee "$out/train_deberta.log" | tail -20 ;;
    graph)
        timeout 560 python3 -m benchmarks.graph --out "$out/graph_h200.json" 2>&1 | tee "$out/graph.log" | tail -50 ;;
    *)
        echo "unknown stage: $stage" >&2; exit 2 ;;
esac
