#!/usr/bin/env bash
# The engine's GPU checks in one run (tests/engine/gpu_prepare.sh readies the wheels and the copier), for a
# lent GPU machine (the device tool) or any CUDA host with torch, triton, transformers and peft: the compiled kernels,
# `kvgate bench engine` (qwen3-0.5b, 1024 and 256 requests) with a GPU profile of the engine, then the engine suites on CUDA. Logs and JSON go to
# ${OUT:-/tmp/kvgate-gpu} (each JSON records the commit, versions, driver and device: copy them to docs/results/, see
# its README; where the copy on the machine is no git checkout, pass KVGATE_COMMIT=$(git rev-parse HEAD)). Further
# stages, named in STAGES, are described where they run. Each stage has its own time limit and a failing stage does not stop the next. Wheels for
# packages the machine lacks are installed from .whl/ when it exists: kvgate itself, llguidance, jsonschema and its
# three dependencies, pyzmq (the CLI imports the chaos bench, which needs it) and msgspec; see the device tool's README.
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
  # HF generate batches as kvgate does (--hf-batch-size match: kvgate's --max-num-seqs, 256 here), not at 64.
  TAIL=20 stage bench256 160 python3 -m kvgate bench engine --model qwen3-0.5b --device cuda --num-requests 256 \
    --max-num-seqs 256 --baselines batched --hf-batch-size match --compare-eager --result-file "$OUT/bench256.json" ;; esac
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
# Production-shaped runs (STAGES=bench1024,sampling,serve, then STAGES=context in a second call: each call under the
# device tool's 10 minutes a command): `sampling` is bench1024
# with the realistic sampling mix (temperature 0.7, top-p 0.9, top-k 50, repetition penalty 1.05, one request in
# 8 with logprobs), and prints its tok/s against bench1024's greedy run of the same session; `serve` starts
# `kvgate serve` with bench1024's engine flags and loads it with 256 streaming clients (1024 requests of ~330 prompt
# and 128 output tokens, as bench1024), then runs the same prompts offline: TTFT p50/p99, ITL, output tok/s and
# served / offline; `context` decodes at batch 1 after prompts of 2k, 8k and 32k tokens (qwen3-0.5b-long: Qwen3's
# 40,960 positions), each context's decode steps against the spec-bandwidth bound.
case ",$STAGES," in *,sampling,*)
  TAIL=16 stage sampling 150 python3 -m kvgate bench engine --model qwen3-0.5b --device cuda --num-requests 1024 \
    --max-num-seqs 256 --max-num-batched-tokens 8192 --baselines none --sampling realistic \
    --result-file "$OUT/sampling.json"
  python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
try:
    greedy, sampled = (json.loads((out / f).read_text())["results"]["kvgate"] for f in ("bench1024.json", "sampling.json"))
except (OSError, KeyError, ValueError) as exc:
    sys.exit(f"sampling against greedy: no pair of results ({exc})")
print(f"realistic sampling {sampled['output_tokens_per_s']:.0f} tok/s against greedy {greedy['output_tokens_per_s']:.0f}: "
      f"{sampled['output_tokens_per_s'] / greedy['output_tokens_per_s']:.3f}")
PY
  ;; esac
case ",$STAGES," in *,serve,*)
  TAIL=22 stage serve 300 python3 -m kvgate bench serve --serve-model qwen3-0.5b \
    --serve-args "--device cuda --max-num-seqs 256 --max-num-batched-tokens 8192" --num-prompts 1024 \
    --random-input-len 330 --random-range-ratio 0.5 --random-output-len 128 --max-concurrency 256 \
    --compare-offline --result-file "$OUT/serve.json" ;; esac
case ",$STAGES," in *,context,*)
  TAIL=30 stage context 240 python3 -m kvgate bench engine --model qwen3-0.5b-long --device cuda --num-requests 2 \
    --max-num-seqs 1 --output-len 256 --context 2048,8192,32768 --max-model-len 33024 --baselines none \
    --result-file "$OUT/context.json" ;; esac
# Quantized KV cache and speculation on the GPU (STAGES=qkernels,spec,kvfp8,spectests): the quantized-cache kernels and speculation on graphs
# under the `cuda` marker; speculation's speed-up at batch 1 and 32, each beside the same workload without it in the
# same process (K=4, the quote workload): copier-wide (a 0.37B Llama computing the trained copier, so prompt lookup's
# drafts are accepted; engine/copier_wide.py) with n-grams and with the tiny copier as its draft model, and
# qwen3-0.5b with n-grams (random weights: drafts mostly fail, what adaptive drafting leaves of their cost); the fp8
# cache's blocks, preemptions and decode speed against bf16 on the same workload and memory. The copier trains on a
# CPU in ~1 min: carry a trained one in $KVGATE_CACHE_DIR to skip that.
case ",$STAGES," in *,qkernels,*)
  TAIL=12 stage qkernels 150 python3 -m pytest -q -s -p no:cacheprovider tests/engine/test_cuda.py \
    -k "quantized or speculation or utilization" ;; esac
case ",$STAGES," in *,spec,*)
  NGRAM='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
  DRAFT='{"method": "draft_model", "model": "copier", "num_speculative_tokens": 4}'
  for run in "copier-wide ngram 1" "copier-wide ngram 32" "copier-wide draft 1" "copier-wide draft 32" \
             "qwen3-0.5b ngram 32" "qwen3-0.5b ngram 1"; do
    set -- $run
    config=$NGRAM; [ "$2" = draft ] && config=$DRAFT
    requests=64; [ "$3" = 1 ] && requests=8
    TAIL=7 stage "spec_$1_$2_b$3" 90 python3 -m kvgate bench engine --model "$1" --device cuda --num-requests \
      "$requests" --max-num-seqs "$3" --max-prompt-len 256 --output-len 128 --max-model-len 1024 --baselines none \
      --speculative-config "$config" --result-file "$OUT/spec_$1_$2_b$3.json"
  done ;; esac
case ",$STAGES," in *,kvfp8,*)
  for memory in default 6GiB; do
    limit=(); [ "$memory" != default ] && limit=(--kv-cache-memory "$memory")
    TAIL=14 stage "kvfp8_$memory" 150 python3 -m kvgate bench engine --model qwen3-0.5b --device cuda \
      --num-requests 1024 --max-num-seqs 256 --max-num-batched-tokens 8192 --baselines none \
      --compare-kv-cache-dtype fp8 "${limit[@]}" --result-file "$OUT/kvfp8_$memory.json"
  done ;; esac
case ",$STAGES," in *,spectests,*)
  # The CPU suites of speculation and the quantized cache on CUDA, less their 10k-request distribution tests.
  TAIL=12 KVGATE_TEST_DEVICE=cuda stage spectests 200 python3 -m pytest -q -p no:cacheprovider \
    tests/engine/test_spec_decode.py tests/engine/test_draft_model.py tests/engine/test_kv_cache_dtype.py \
    tests/engine/test_copier_wide.py -k "not keeps_the_distribution and not test_bench" ;; esac
# The MoE and quantized-weight kernels (STAGES=moe,fp8; 150 s together): qwen3-moe-tiny (a scaled-down
# Qwen3-30B-A3B, random weights) through the fused Triton experts (CUDA graphs) and through the torch reference
# (torch_experts, eager) on the same workload: tok/s of both, identical greedy outputs, decode steps against the
# bound; then the kernels alone (tests/engine/gpu_kernel_bench.py): the fused experts against torch_experts, and the
# int8/int4/FP8 weight GEMMs against the bf16 matmul.
case ",$STAGES," in *,moe,*)
  TAIL=22 stage moe 90 python3 -m kvgate bench engine --model qwen3-moe-tiny --device cuda --num-requests 128 \
    --max-num-seqs 128 --max-prompt-len 256 --output-len 64 --max-cudagraph-capture-size 512 --baselines none \
    --compare-moe-reference --result-file "$OUT/moe.json" ;; esac
case ",$STAGES," in *,fp8,*)
  TAIL=60 stage fp8 60 python3 -m tests.engine.gpu_kernel_bench moe quant ;; esac
# Split-KV decode (STAGES=splitkv; ~4 min, ~8 with the engine runs): the compiled kernels against the float64
# reference (test_cuda.py -k split_decode; also part of `kernels`), the kernels alone (gpu_kernel_bench.py splitkv: batch 1 and 4
# at 8k and 32k tokens, bf16 and fp8 caches, split against one program a KV head, each against the spec and copy
# bandwidth and a float64 reference; exit 1 past its tolerance), then the engine's batch-1 decode after 8k and 32k
# prompts with split-KV (the default) and without (--max-decode-splits 1), where `kvgate bench engine` has --context.
case ",$STAGES," in *,splitkv,*)
  TAIL=8 stage splitkv_tests 100 python3 -m pytest -x -q -p no:cacheprovider tests/engine/test_cuda.py -k split_decode
  TAIL=40 stage splitkv 120 python3 -m tests.engine.gpu_kernel_bench splitkv
  if python3 -m kvgate bench engine --help 2>/dev/null | grep -q -- "--context"; then
    for splits in 32 1; do
      TAIL=20 stage "splitkv_engine_s$splits" 150 python3 -m kvgate bench engine --model qwen3-0.5b-long \
        --device cuda --num-requests 2 --max-num-seqs 1 --output-len 256 --context 8192,32768 --max-model-len 33024 \
        --max-decode-splits "$splits" --baselines none --result-file "$OUT/splitkv_engine_s$splits.json"
    done
  else
    echo "=== splitkv_engine: skipped (kvgate bench engine has no --context here)"
  fi ;; esac
case ",$STAGES," in *,sweep,*)
  TAIL=30 stage sweep 120 python3 -m tests.engine.gpu_profile attention ;; esac
