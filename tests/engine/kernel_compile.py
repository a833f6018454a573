"""Compile the MoE, quantized-weight and split-KV decode kernels for a GPU architecture without a GPU (triton.compile
with an explicit target: Triton's front end, LLVM and the bundled ptxas, no driver), one line per kernel variant:

    python -m tests.engine.kernel_compile 90 [bf16 fp16 fp32]   # sm_90 (H100); 80: sm_80 (A100), 89: sm_89 (L4)

What the interpreter cannot check (tests/engine/test_triton_compile.py runs this): the compiled language's type
rules, the architecture's limits (fp8e4nv needs sm_89; shared memory a block), the lowering of every constexpr
branch. Must run without
TRITON_INTERPRET (the kernels must be JIT functions, not interpreted ones)."""

from __future__ import annotations

import sys

MOE_ARGS = ("num_pairs", "H", "I")
MOE_STRIDES = ("stride_we", "stride_wn", "stride_wk", "stride_ot")
# the most shared memory a block may use (opt-in), bytes: A100, L4/L40 (Ada), H100
SHARED_MEMORY_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
GEMM_INTS = ("M", "N", "K", "stride_xm", "stride_wn", "stride_sn", "stride_sk", "stride_zn", "stride_zk",
             "stride_om", "GROUP_N", "GROUP_K")


def _variants(dtypes, arch: int = 90):
    """(name, kernel, signature, constexprs, options) of every variant the wrappers launch, per activation dtype."""
    from kvgate.engine import triton_moe as tm, triton_quant as tq

    for dt in dtypes:
        ieee = dt == "fp32"
        ints = {a: "i32" for a in MOE_ARGS + MOE_STRIDES}
        gate_up = dict(x_ptr=f"*{dt}", w_ptr=f"*{dt}", out_ptr=f"*{dt}", sorted_pairs_ptr="*i32",
                       block_expert_ptr="*i32", num_padded_ptr="*i32", **ints, stride_xt="i32")
        for block_m, block_n in ((16, 32), (64, 64)):
            blocks = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, IEEE=ieee, INTERPRETED_BF16=False)
            yield (f"moe gate_up {dt} {block_m}x{block_n}", tm._moe_gate_up_kernel, gate_up,
                   dict(TOP_K=8, **blocks), {})
            for weights in ("fp32", dt):  # Mixtral keeps the routing weights in fp32, Qwen3-MoE in the model dtype
                down = dict(h_ptr=f"*{dt}", w_ptr=f"*{dt}", out_ptr=f"*{dt}", topk_weights_ptr=f"*{weights}",
                            sorted_pairs_ptr="*i32", block_expert_ptr="*i32", num_padded_ptr="*i32", **ints,
                            stride_ht="i32")
                yield f"moe down {dt} {block_m}x{block_n} weights {weights}", tm._moe_down_kernel, down, blocks, {}
        # FORMAT: 0 int8, 1 int4, 2 fp8 (Triton's conversion), 3 fp8 bits decoded in integer arithmetic
        for fmt, weight, scale, zeros in ((0, "*u8", f"*{dt}", None), (0, "*u8", f"*{dt}", "*u8"),
                                          (1, "*u8", f"*{dt}", None), (1, "*u8", f"*{dt}", "*i32"),
                                          (2, "*fp8e4nv", "*fp32", None), (3, "*u8", "*fp32", None)):
            for per_tile in (True, False):
                sig = dict(x_ptr=f"*{dt}", w_ptr=weight, scale_ptr=scale, zero_ptr=zeros or scale,
                           out_ptr=f"*{dt}", **{a: "i32" for a in GEMM_INTS})
                consts = dict(FORMAT=fmt, HAS_ZEROS=zeros is not None, ZERO=8 if fmt == 1 else 128,
                              SCALE_PER_TILE=per_tile, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, IEEE=ieee,
                              INTERPRETED_BF16=False)
                name = f"weight_gemm format {fmt} {dt} zeros {zeros} per-tile {per_tile}"
                yield name, tq._weight_gemm_kernel, sig, consts, {}
        yield from _split_decode_variants(dt, arch)


# The split-KV decode kernels (triton_split_decode.py) at head_dim 128: GQA 2 (Qwen3-0.6B) and 8 (Llama-3-70B), a
# window, the quantized caches (fp8 only from sm_89: model_runner.check_kv_cache_backend refuses it below).
SPLIT_DECODE_INTS = ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_po_s", "stride_po_h", "stride_po_k",
                     "stride_pl_s", "stride_pl_h", "stride_cache_kv", "stride_cache_h", "stride_cache_s",
                     "stride_scale_kv", "stride_scale_h", "stride_bt")
SPLIT_MERGE_INTS = ("stride_ot", "stride_oh", "stride_po_s", "stride_po_h", "stride_po_k", "stride_pl_s",
                    "stride_pl_h")


def _split_decode_variants(dt: str, arch: int):
    from kvgate.engine import triton_attention as ta, triton_split_decode as sd

    elem = 4 if dt == "fp32" else 2
    tile, stages = ta.fit_tiles(ta.DECODE_LAUNCH["tile"], ta.DECODE_LAUNCH["num_stages"], 128, elem,
                                SHARED_MEMORY_LIMIT.get(arch, 101376))
    # (cache values, quantized, query heads a KV head, window)
    cases = [("*" + dt, False, 2, 0), ("*" + dt, False, 8, 4096), ("*i8", True, 8, 0)]
    if arch >= 89:
        cases += [("*fp8e4nv", True, 2, 0), ("*fp8e5", True, 2, 0)]
    for cache, quant, group, window in cases:
        sig = dict(q_ptr=f"*{dt}", o_ptr=f"*{dt}", part_o_ptr="*fp32", part_lse_ptr="*fp32", cache_ptr=cache,
                   scales_ptr="*fp32" if quant else cache, block_table_ptr="*i32", seq_lens_ptr="*i32",
                   query_start_ptr="*i32", scale="fp32", **{a: "i32" for a in SPLIT_DECODE_INTS})
        consts = dict(G=group, D=128, BLOCK_D=128, BLOCK_M=16, BLOCK_SIZE=16, TILE=tile, WINDOW=window,
                      IEEE=dt == "fp32", QUANT=quant, NUM_SPLITS=sd.MAX_SPLITS,
                      MIN_SPLIT_TILES=sd.MIN_SPLIT_TOKENS // tile)
        yield (f"split_decode {dt} cache {cache[1:]} G {group} window {window} tile {tile} stages {stages}",
               sd._split_decode_kernel, sig, consts, dict(num_warps=ta.DECODE_LAUNCH["num_warps"], num_stages=stages))
    sig = dict(o_ptr=f"*{dt}", part_o_ptr="*fp32", part_lse_ptr="*fp32", seq_lens_ptr="*i32", query_start_ptr="*i32",
               **{a: "i32" for a in SPLIT_MERGE_INTS})
    consts = dict(D=128, BLOCK_D=128, TILE=tile, WINDOW=0, NUM_SPLITS=sd.MAX_SPLITS, BLOCK_S=sd.MAX_SPLITS,
                  MIN_SPLIT_TILES=sd.MIN_SPLIT_TOKENS // tile)
    yield f"split_merge {dt}", sd._split_merge_kernel, sig, consts, dict(num_warps=1)


def main(arch: int, dtypes=("bf16", "fp16", "fp32")) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    failed = 0
    for name, kernel, signature, constexprs, options in _variants(dtypes, arch):
        for key in constexprs:
            signature[key] = "constexpr"
        try:
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                      target=target, options=options or None)
            shared = compiled.metadata.shared
            if shared > SHARED_MEMORY_LIMIT.get(arch, 101376):
                failed += 1
                print(f"FAILED sm_{arch} {name}: {shared} bytes of shared memory, more than the architecture's "
                      f"{SHARED_MEMORY_LIMIT.get(arch, 101376)}", flush=True)
                continue
            print(f"ok sm_{arch} {name}: {len(compiled.asm['cubin'])} bytes of cubin, {shared} bytes of shared "
                  f"memory", flush=True)
        except Exception as exc:  # noqa: BLE001 - reported per variant; the exit status counts them
            failed += 1
            print(f"FAILED sm_{arch} {name}: {type(exc).__name__}: {str(exc).splitlines()[-1][:300]}", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(min(main(int(sys.argv[1]) if len(sys.argv) > 1 else 90, sys.argv[2:] or ("bf16", "fp16", "fp32")), 100))
