#!/usr/bin/env bash
# The GPU checks of issue 19 in one run, for a lent GPU machine (the device tool) or any CUDA host with torch,
# triton, transformers and peft: the compiled kernels, `kvgate bench engine` (the must-show runs), then the engine
# suites on CUDA. Logs and JSON go to ${OUT:-/tmp/kvgate-gpu}. Each stage has its own time limit and a failing stage
# does not stop the next. Wheels for packages the machine lacks are installed from .whl/ when it exists: kvgate
# itself, llguidance, jsonschema and its three dependencies, and pyzmq (the CLI imports the chaos bench, which needs
# it); see the device tool's README.
set -u
OUT=${OUT:-/tmp/kvgate-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
stage() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL:-25}" "$OUT/$name.log"
  echo "=== $name: exit $rc in $((SECONDS - t0)) s"
}
STAGES=${STAGES:-bench1024,profile,bench256,suites}
# The compiled kernels against the float64 reference are part of `suites` (test_cuda.py); `kernels` runs them alone.
case ",$STAGES," in *,kernels,*)
  TAIL=8 stage kernels 100 python3 -m pytest -x -q -p no:cacheprovider tests/engine/test_cuda.py -k compiled ;; esac
case ",$STAGES," in *,bench1024,*)
  # The bf16 first-token agreement with HF (and its floor) comes from bench256, whose HF baseline computes it on 256
  # prompts; over 1024 (--hf-first-tokens) it took longer than the rest of this stage on a slower host.
  TAIL=16 stage bench1024 140 python3 -m kvgate bench engine --model qwen3-0.5b --device cuda --num-requests 1024 \
    --max-num-seqs 256 --max-num-batched-tokens 8192 --baselines none --compare-sync \
    --result-file "$OUT/bench1024.json" ;; esac
case ",$STAGES," in *,profile,*)
  TAIL=45 stage profile 50 python3 -m tests.engine.gpu_profile engine ;; esac
case ",$STAGES," in *,bench256,*)
  TAIL=20 stage bench256 140 python3 -m kvgate bench engine --model qwen3-0.5b --device cuda --num-requests 256 \
    --baselines batched --hf-batch-size 64 --compare-eager --result-file "$OUT/bench256.json" ;; esac
case ",$STAGES," in *,bf16,*)
  # The bf16 first-token check alone (no HF generate baseline): agreement, its floor, and the prompts bf16 decides.
  TAIL=12 stage bf16 120 python3 -m kvgate bench engine --model qwen3-0.5b --device cuda --num-requests 256 \
    --baselines none --hf-first-tokens --result-file "$OUT/bf16.json" ;; esac
case ",$STAGES," in *,suites,*)
  # test_bench_prints_the_ratio runs the `kvgate` console script beside python3, which a --target install of the
  # wheel does not put there.
  TAIL=30 KVGATE_TEST_DEVICE=cuda stage suites 220 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py \
    tests/engine/test_async_scheduling.py tests/engine/test_hf_parity.py tests/engine/test_lora_parity.py \
    tests/engine/test_structured_outputs.py \
    --deselect tests/engine/test_structured_outputs.py::test_bench_prints_the_ratio ;; esac
case ",$STAGES," in *,sweep,*)
  TAIL=30 stage sweep 120 python3 -m tests.engine.gpu_profile attention ;; esac
