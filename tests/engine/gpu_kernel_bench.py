"""The MoE, quantized-weight and split-KV decode kernels alone on a GPU, against their torch counterparts or the
kernels they replace (run by tests/engine/gpu_check.sh's `moe`, `fp8` and `splitkv` stages; not a test).

    python -m tests.engine.gpu_kernel_bench [moe] [quant] [splitkv] [--device cpu] [--contexts 8192,32768]

moe:   triton_moe.triton_experts against torch_experts on a layer of qwen3-moe-tiny (the bench's random model) and of
       Qwen3-30B-A3B, from one token to a prefill chunk: time, speed-up, the bytes of the experts the tokens route to
       against the copy bandwidth, and the difference between the two.
quant: triton_quant's GEMMs (int8 and int4 weight-only, FP8 per channel and block-wise, torch._scaled_mm's FP8 where
       the device has it) against the bf16 matmul of the same weights dequantized, on a 4096 x 4096 and a
       14336 x 4096 projection (Llama-3-8B's) for 1, 16 and 256 rows: time, weight bytes, bandwidth, error.
splitkv: decode attention of one layer at batch 1 and 4 over 8k and 32k-token contexts (--contexts), Qwen3-0.6B's
       and Llama-3-8B's heads (16 or 32 query heads, 8 KV heads, head_dim 128; bf16 and, from sm_89, an fp8 cache),
       triton_split_decode's kernels (splits from plan_splits) against triton_attention's one program a (sequence,
       KV head), each as a CUDA graph replay: time, speed-up, the K/V bytes read against the device's spec
       bandwidth (bench/device_spec.py, by device name) and the measured copy bandwidth, and the difference from a float64
       reference.
--device cpu runs every kernel once on tiny sizes under Triton's interpreter: the check that the script runs.
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def _timer(device: torch.device):
    """ms of one call of fn: triton's do_bench on CUDA, one timed call on CPU (the interpreter: a check, no speed)."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")

    def once(fn):
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)

    return once


def _graphed(fn, device: torch.device):
    """fn as one CUDA graph replay (as a decode step runs attention: no host launch cost between the kernels);
    fn itself on CPU."""
    if device.type != "cuda":
        return fn
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()  # compiles the kernels outside the capture
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30)).item()


def moe_bench(device: torch.device, bandwidth: float) -> None:
    from kvgate.engine.models.moe import select_experts, torch_experts
    from kvgate.engine.triton_moe import triton_experts

    timed = _timer(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # (name, experts, top-k, hidden, width)
    layers = [("qwen3-moe-tiny", 64, 8, 1024, 384), ("qwen3-30b-a3b", 128, 8, 2048, 768)]
    token_counts = [1, 64, 256, 2048]
    if device.type != "cuda":
        layers, token_counts = [("tiny", 6, 2, 48, 40)], [1, 9]
    print(f"MoE experts ({dtype}): triton_experts vs torch_experts; bytes = the routed experts' weights")
    for name, experts, top_k, hidden, inter in layers:
        g = torch.Generator(device=device).manual_seed(0)
        w13 = torch.randn(experts, 2 * inter, hidden, device=device, dtype=dtype, generator=g) * hidden**-0.5
        w2 = torch.randn(experts, hidden, inter, device=device, dtype=dtype, generator=g) * inter**-0.5
        for tokens in token_counts:
            x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=g)
            logits = torch.randn(tokens, experts, device=device, dtype=dtype, generator=g)
            weights, ids = select_experts(logits, top_k, renormalize=True, weights_in_fp32=False)
            routed = int(ids.unique().numel())
            nbytes = routed * 3 * inter * hidden * w13.element_size()
            fused = timed(lambda: triton_experts(x, w13, w2, weights, ids))
            ref = timed(lambda: torch_experts(x, w13, w2, weights, ids))
            err = _rel_err(triton_experts(x, w13, w2, weights, ids), torch_experts(x, w13, w2, weights, ids))
            print(f"  {name:<15} T={tokens:<5} experts used {routed:>3}: fused {1e3 * fused:8.1f} us, torch "
                  f"{1e3 * ref:8.1f} us ({ref / fused:5.2f}x); {nbytes / 1e6:6.1f} MB at "
                  f"{nbytes / fused / 1e6:6.0f} GB/s ({100 * nbytes / fused * 1e3 / bandwidth:5.1f}% of copy); "
                  f"rel. difference {err:.1e}")


def quant_bench(device: torch.device, bandwidth: float) -> None:
    import torch.nn.functional as F

    from kvgate.engine import triton_quant as tq

    timed = _timer(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes, rows, group = [(4096, 4096), (14336, 4096)], [1, 16, 256], 128
    if device.type != "cuda":
        shapes, rows, group = [(48, 64)], [1, 20], 32
    scaled_mm = device.type == "cuda" and tq.scaled_mm_supported(torch.empty(1, 16, device=device, dtype=dtype),
                                                                torch.empty(16, 16, device=device))
    print(f"quantized-weight GEMMs vs the {dtype} matmul of the dequantized weights; torch._scaled_mm FP8 "
          f"path: {'yes' if scaled_mm else 'no (needs compute capability 9.0 and bf16)'}")
    for n, k in shapes:
        g = torch.Generator(device=device).manual_seed(0)
        q8 = torch.randint(0, 256, (n, k), device=device, dtype=torch.uint8, generator=g)
        q4 = torch.randint(0, 16, (n, k), device=device, dtype=torch.uint8, generator=g)
        packed = tq.pack_int4(q4)
        scales = (torch.rand(n, k // group, device=device, generator=g) * 0.01).to(dtype)
        zeros = torch.randint(0, 16, (n, k // group), device=device, dtype=torch.int8, generator=g)
        w_fp8 = (torch.randn(n, k, device=device, generator=g) * 50).to(torch.float8_e4m3fn)
        ch_scale = torch.rand(n, device=device, generator=g) * 0.004
        blk_scale = torch.rand(-(-n // 128), -(-k // 128), device=device, generator=g) * 0.004
        w_int8 = tq.dequantize_int_weight(q8, scales, None, 8, group)
        cases = [  # name, weight bytes, kernel, the same weights dequantized
            ("int8 g%d" % group, q8.numel() + scales.numel() * 2,
             lambda x: tq.int_weight_gemm(x, q8, scales, None, 8, group), w_int8),
            ("int4 g%d" % group, packed.numel() + scales.numel() * 2,
             lambda x: tq.int_weight_gemm(x, packed, scales, None, 4, group),
             tq.dequantize_int_weight(packed, scales, None, 4, group)),
            ("int4 g%d zeros" % group, packed.numel() + scales.numel() * 3,
             lambda x: tq.int_weight_gemm(x, packed, scales, zeros, 4, group),
             tq.dequantize_int_weight(packed, scales, zeros, 4, group)),
            ("fp8 channel (Triton)", w_fp8.numel() + n * 4,
             lambda x: tq.fp8_triton_gemm(x, w_fp8, ch_scale), tq.dequantize_fp8_weight(w_fp8, ch_scale, None, dtype)),
            ("fp8 block 128", w_fp8.numel() + blk_scale.numel() * 4,
             lambda x: tq.fp8_weight_gemm(x, w_fp8, blk_scale, (128, 128)),
             tq.dequantize_fp8_weight(w_fp8, blk_scale, (128, 128), dtype)),
        ]
        if scaled_mm:
            cases.append(("fp8 channel (_scaled_mm)", w_fp8.numel() + n * 4,
                          lambda x: tq.fp8_scaled_mm(x, w_fp8, ch_scale),
                          tq.dequantize_fp8_weight(w_fp8, ch_scale, None, dtype)))
        for m in rows:
            x = torch.randn(m, k, device=device, dtype=dtype, generator=g)
            dense_bytes = n * k * w_int8.element_size()
            dense = timed(lambda: F.linear(x, w_int8))
            print(f"  [{m} x {k}] @ [{n} x {k}]^T: {dtype} matmul {1e3 * dense:8.1f} us, "
                  f"{dense_bytes / 1e6:6.1f} MB at {dense_bytes / dense / 1e6:6.0f} GB/s "
                  f"({100 * dense_bytes / dense * 1e3 / bandwidth:5.1f}% of copy)")
            for name, nbytes, fn, w in cases:
                ms = timed(lambda: fn(x))
                err = _rel_err(fn(x), F.linear(x.double(), w.double()))
                print(f"    {name:<25} {1e3 * ms:8.1f} us ({dense / ms:5.2f}x the matmul), {nbytes / 1e6:6.1f} MB "
                      f"at {nbytes / ms / 1e6:6.0f} GB/s ({100 * nbytes / ms * 1e3 / bandwidth:5.1f}% of copy); "
                      f"rel. error {err:.1e}")


# Spec (datasheet) memory bandwidth, bytes/s: (words the device name must contain, words it must not, bandwidth),
# the first match counts. The H100 SXM module is named "NVIDIA H100 80GB HBM3", its PCIe card "NVIDIA H100 PCIe";
# the NVL card is not listed (no spec bound rather than a guess).
def spec_bandwidth(device_name: str) -> float | None:
    """The datasheet bandwidth of a device by its name (torch.cuda.get_device_name), None for an unlisted one: the
    bench's table (bench/device_spec.py)."""
    from kvgate.bench.device_spec import spec_bandwidth as table_entry

    entry = table_entry(device_name)
    return None if entry is None else entry.bytes_per_s


def _contexts(text: str) -> list[int]:
    """--contexts: comma-separated token counts in [1, 1048576]."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--contexts takes comma-separated integers, got {text!r}") from None
    if not values or len(values) > 8 or any(not 1 <= v <= 1 << 20 for v in values):
        raise argparse.ArgumentTypeError(f"--contexts takes 1 to 8 token counts in [1, 1048576], got {text!r}")
    return values


def _paged_decode_batch(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                        dtype: torch.dtype, device: torch.device, seed: int = 0):
    """q, a cache of exactly the batch's blocks (shuffled), block table, seq_lens, query_start_loc for `batch`
    decodes of `context` tokens each (the query the last)."""
    g = torch.Generator(device=device).manual_seed(seed)
    blocks = -(-context // block_size)
    order = torch.randperm(batch * blocks, device=device, generator=g).to(torch.int32)
    table = order.view(batch, blocks)
    cache = torch.randn(2, kv_heads, batch * blocks * block_size, head_dim, device=device, dtype=dtype, generator=g)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype, generator=g)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
    return q, cache, table, lens, starts


# splitkv: the largest relative difference from the float64 reference either kernel may show (bf16 products)
SPLITKV_TOLERANCE = 2e-2


def splitkv_bench(device: torch.device, copy_bw: float, spec_bw: float | None, contexts: list[int]) -> float:
    """Prints a line per case; returns the largest relative difference from the reference of either kernel."""
    from kvgate.engine import triton_attention as ta, triton_split_decode as sd
    from kvgate.engine.kv_quant import QuantizedKVCache, dequantize, kv_quant_spec, quantize
    from tests.engine.paged_reference import reference_attention

    timed = _timer(device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    heads_list, batches, block_size, head_dim, kv_heads = [16, 32], [1, 4], 16, 128, 8
    caches = ["auto"] + (["fp8_e4m3"] if cuda and torch.cuda.get_device_capability(device) >= (8, 9) else [])
    if not cuda:
        heads_list, batches, head_dim, kv_heads, caches = [4], [1], 32, 2, ["auto", "int8"]
    sms = sd.sm_count(device)
    worst = 0.0
    bound = f"{spec_bw / 1e12:.2f} TB/s spec" if spec_bw else "spec bandwidth unknown for this device"
    print(f"split-KV decode ({dtype}, head_dim {head_dim}, {kv_heads} KV heads, {sms} SMs): "
          f"triton_split_decode vs triton_attention's decode kernel; bytes = the K/V (and scales) read; bound: "
          f"{bound}, copy {copy_bw / 1e12:.2f} TB/s")
    for cache_dtype in caches:
        for heads in heads_list:
            for batch in batches:
                for context in contexts:
                    q, cache, table, lens, starts = _paged_decode_batch(batch, context, heads, kv_heads, head_dim,
                                                                        block_size, dtype, device)
                    kv, ref_cache = cache, cache
                    if cache_dtype != "auto":
                        values, scales = quantize(cache, kv_quant_spec(cache_dtype))
                        kv = QuantizedKVCache(values, scales, kv_quant_spec(cache_dtype))
                        ref_cache = dequantize(values, scales, kv_quant_spec(cache_dtype), dtype)
                    per_token = 2 * kv_heads * head_dim * (1 if cache_dtype != "auto" else cache.element_size())
                    nbytes = batch * context * (per_token + (2 * kv_heads * 4 if cache_dtype != "auto" else 0))
                    splits = sd.plan_splits(batch, kv_heads, sms)
                    common = dict(scale=head_dim**-0.5, block_size=block_size)
                    out_one, out_split = torch.empty_like(q), torch.empty_like(q)
                    one = timed(_graphed(lambda: ta.paged_attention(q, kv, out_one, table, lens, starts,
                                                                    decode_only=True, **common), device))
                    split = timed(_graphed(lambda: sd.split_decode_attention(q, kv, out_split, table, lens, starts,
                                                                             num_splits=splits, **common), device))
                    ref = reference_attention(q, ref_cache, table, lens, starts, head_dim**-0.5, block_size)
                    err_one, err_split = _rel_err(out_one, ref), _rel_err(out_split, ref)
                    worst = max(worst, err_one, err_split)
                    of_spec = f"{100 * nbytes / split * 1e3 / spec_bw:5.1f}% of spec" if spec_bw else "spec ?"
                    print(f"  cache {cache_dtype:<8} H={heads:<2} B={batch} ctx={context:<6} splits {splits:>2}: "
                          f"split {1e3 * split:8.1f} us, one program {1e3 * one:8.1f} us ({one / split:5.2f}x); "
                          f"{nbytes / 1e6:7.1f} MB at {nbytes / split / 1e6:6.0f} GB/s ({of_spec}, "
                          f"{100 * nbytes / split * 1e3 / copy_bw:5.1f}% of copy; one program "
                          f"{100 * nbytes / one * 1e3 / (spec_bw or copy_bw):5.1f}%); rel. error split "
                          f"{err_split:.1e}, one program {err_one:.1e}", flush=True)
    return worst


PARTS = ("moe", "quant", "splitkv")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", help="moe, quant, splitkv (default: moe and quant)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--contexts", type=_contexts, default=None,
                        help="splitkv: comma-separated context lengths (default: 8192,32768 on CUDA, 1500 on CPU)")
    args = parser.parse_args(argv)
    if set(args.parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(set(args.parts) - set(PARTS))}: {', '.join(PARTS)}")
    args.parts = args.parts or ["moe", "quant"]
    if args.contexts is None:
        args.contexts = [8192, 32768] if torch.device(args.device).type == "cuda" else [1500]
    return args


def main(argv=None) -> int:
    """0, or 1 when a kernel's output differs from the reference by more than its tolerance."""
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' modules import triton
    from kvgate.bench.engine_roofline import copy_bandwidth

    bandwidth = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (1 << 24))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    spec = spec_bandwidth(name)
    print(f"{name}: copy bandwidth {bandwidth / 1e9:.0f} GB/s, spec bandwidth "
          f"{f'{spec / 1e9:.0f} GB/s' if spec else 'unknown'}")
    if "moe" in args.parts:
        moe_bench(device, bandwidth)
    if "quant" in args.parts:
        quant_bench(device, bandwidth)
    if "splitkv" in args.parts:
        worst = splitkv_bench(device, bandwidth, spec, args.contexts)
        if not worst < SPLITKV_TOLERANCE:
            print(f"FAILED splitkv: a relative difference of {worst:.1e} from the reference (tolerance "
                  f"{SPLITKV_TOLERANCE:.0e})")
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
