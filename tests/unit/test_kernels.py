"""kvwise's C++ kernels (kernels/csrc) against plain-torch references.

The paged decode kernel must equal SDPA over the gathered blocks for any block table, any mix
of context lengths, GQA groups and head sizes (the vectorised 64/128 paths and the scalar
one); the fused layer steps must equal the torch ops they replace, up to bfloat16 rounding.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kvwise import kernels
from kvwise.core.kv_spec import KVSpec
from kvwise.models.layers import (
    apply_rope,
    gelu_tanh_glu,
    rms_norm,
    rms_norm_one_plus,
    rope_table,
    silu_glu,
)
from kvwise.models.quant import Int4Weight, Q8Weight
from kvwise.worker.kv_cache import make_kv_cache

if not kernels.available():
    if os.environ.get("CI"):
        pytest.fail("the kvwise kernels did not build in CI", pytrace=False)
    pytest.skip("the kvwise kernels are unavailable here", allow_module_level=True)

ops = torch.ops.kvwise


def _reference(q, k_cache, v_cache, tables, lens):
    block_size, kv_heads, dim = k_cache.shape[1:]
    outs = []
    for b in range(q.shape[0]):
        ids = tables[b]
        k = k_cache[ids].reshape(-1, kv_heads, dim)[: lens[b]].transpose(0, 1)
        v = v_cache[ids].reshape(-1, kv_heads, dim)[: lens[b]].transpose(0, 1)
        out = F.scaled_dot_product_attention(q[b].unsqueeze(1), k, v, enable_gqa=True)
        outs.append(out.squeeze(1))
    return torch.stack(outs)  # (B, H, D)


def _scattered_tables(lengths, block_size, num_blocks, gen):
    """Block tables `(B, max_blocks)` in which each sequence owns scattered blocks; padding
    entries point at block 0."""
    max_blocks = -(-max(lengths) // block_size)
    order = torch.randperm(num_blocks, generator=gen)
    tables, used = torch.zeros(len(lengths), max_blocks, dtype=torch.long), 0
    for b, n in enumerate(lengths):
        count = -(-n // block_size)
        tables[b, :count] = order[used : used + count]
        used += count
    return tables


@pytest.mark.parametrize(
    "heads,kv_heads,dim,block_size",
    [(9, 3, 64, 16), (8, 8, 128, 16), (4, 1, 32, 8), (6, 2, 20, 4)],
)
@pytest.mark.parametrize("lengths", [[1], [17], [2100], [300, 5, 64, 1], [90] * 16])
def test_paged_decode_attention_matches_sdpa_over_the_gathered_blocks(
    heads, kv_heads, dim, block_size, lengths
):
    gen = torch.Generator().manual_seed(len(lengths) * 1000 + dim)
    num_blocks = 4 + sum(-(-n // block_size) for n in lengths)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    tables = _scattered_tables(lengths, block_size, num_blocks, gen)
    q = torch.randn(len(lengths), heads, dim, generator=gen) * 3  # peaked softmaxes too
    lens = torch.tensor(lengths)
    got = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5)
    want = _reference(q, k_cache, v_cache, tables, lens)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("block_size", [16, 8, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 100])
def test_rows_over_shared_prefix_blocks_get_the_bits_they_get_alone(block_size, dtype, window):
    """Decode rows of different sequences whose tables share their first blocks (one cached
    system prompt, a forked conversation) compute each shared span once for all of them: every
    row's output has the same bits as that row attending alone, beside a prefill chunk's rows
    (one sequence at several positions) and an unrelated row, and matches SDPA."""
    gen = torch.Generator().manual_seed(block_size + window)
    heads, kv_heads, dim, prefix = 9, 3, 64, 13 * block_size
    num_blocks = 200
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    shared, rest = order[: prefix // block_size], order[prefix // block_size :]
    lengths = [prefix + n for n in (1, 5, 40, 0, 77, 3)] + [prefix // 2, 150, 151, 152]
    max_blocks = -(-max(lengths) // block_size)
    tables = torch.zeros(len(lengths), max_blocks, dtype=torch.long)
    for b, n in enumerate(lengths):
        own = shared[: -(-n // block_size)] if b < 8 else []
        if b >= 8:  # rows 8.. : one sequence's prefill chunk, its own blocks
            own = rest[100 : 100 + -(-n // block_size)]
        need = -(-n // block_size) - len(own)
        own, rest = own + rest[:need], rest[need:] if b < 8 else rest
        tables[b, : len(own)] = torch.tensor(own)
    q = torch.randn(len(lengths), heads, dim, generator=gen) * 3
    lens = torch.tensor(lengths)
    args = {"window": window} if window else {}
    got = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5, **args)
    for b in range(len(lengths)):
        alone = ops.paged_decode_attention(q[b : b + 1], k_cache, v_cache, tables[b : b + 1],
                                           lens[b : b + 1], dim**-0.5, **args)  # fmt: skip
        assert torch.equal(got[b], alone[0]), b
    if not window:
        want = _reference(q, k_cache.float(), v_cache.float(), tables, lens)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_paged_decode_attention_refuses_a_length_beyond_its_table():
    cache = torch.zeros(4, 16, 1, 64)
    with pytest.raises(RuntimeError, match="context length"):
        ops.paged_decode_attention(
            torch.zeros(1, 1, 64), cache, cache, torch.zeros(1, 2, dtype=torch.long),
            torch.tensor([33]), 0.125,
        )  # fmt: skip


@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_fused_norms_match_torch(tokens):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 576, generator=gen) * 4
    w = torch.randn(576, generator=gen)
    want = rms_norm(x, w, 1e-5).to(torch.bfloat16)
    torch.testing.assert_close(ops.rms_norm_bf16(x, w, 1e-5), want, atol=0, rtol=1e-2)
    y = torch.randn(tokens, 576, generator=gen).to(torch.bfloat16)
    residual = x.clone()
    got = ops.add_rms_norm_bf16(residual, y, w, 1e-5)
    torch.testing.assert_close(residual, x + y.float())  # updated in place
    torch.testing.assert_close(got, rms_norm(x + y.float(), w, 1e-5).to(torch.bfloat16),
                               atol=0, rtol=1e-2)  # fmt: skip


@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_float32_norms_match_the_families_norms(tokens, offset):
    """Llama's RMSNorm (offset 0) and Gemma's by 1 + w (offset 1), alone and added to the
    residual after it (a post-norm), within float32 rounding of the torch forms."""
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 640, generator=gen) * 4
    w = torch.randn(640, generator=gen) * 0.3
    norm = rms_norm_one_plus if offset else rms_norm
    torch.testing.assert_close(ops.rms_norm_f32(x, w, 1e-6, offset), norm(x, w, 1e-6))
    residual = torch.randn(tokens, 640, generator=gen)
    want = residual + norm(x, w, 1e-6)
    ops.add_rms_normed_f32(residual, x, w, 1e-6, offset)
    torch.testing.assert_close(residual, want)
    if not offset:  # without an offset the weight is used as it is: Llama's bits unchanged
        assert torch.equal(ops.rms_norm_f32(x, w, 1e-6), ops.rms_norm_f32(x, w, 1e-6, 0.0))


@pytest.mark.parametrize("inter", [8, 2051])  # a tail past the eight-wide body
def test_glu_ops_match_torch(inter):
    gen = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(5, 2 * inter, generator=gen) * 4
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 1e-5, -1e-5, 9.0, -9.0, 30.0, -30.0])
    want = gelu_tanh_glu(gate_up.clone(), inter)
    torch.testing.assert_close(ops.gelu_tanh_mul_f32(gate_up), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.silu_mul_f32(gate_up), silu_glu(gate_up.clone(), inter))


@pytest.mark.parametrize("bias,qk_norm", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_qkv_rope_matches_the_torch_steps(bias, qk_norm, dtype):
    heads, kv_heads, dim, tokens = 9, 3, 64, 5
    gen = torch.Generator().manual_seed(7)
    width = (heads + 2 * kv_heads) * dim
    qkv = torch.randn(tokens, width, generator=gen).to(dtype)
    b = torch.randn(width, generator=gen) if bias else None
    norm = torch.randn(heads + kv_heads, dim, generator=gen) if qk_norm else None
    rope = rope_table(4096, dim, 10000.0, None)[torch.tensor([0, 1, 40, 1000, 4095])]
    cos, sin = rope[:, 0:1], rope[:, 1:2]
    x = qkv.float() + (b if bias else 0)
    qk = x[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
    if qk_norm:
        qk = rms_norm(qk, norm, 1e-6)
    qk = apply_rope(qk, cos, sin)
    q, k, v = ops.qkv_rope(qkv, b, norm, cos, sin, heads, kv_heads, 1e-6)
    torch.testing.assert_close(q, qk[:, :heads])
    torch.testing.assert_close(k, qk[:, heads:])
    torch.testing.assert_close(v, x[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim))
    if qk_norm:  # Gemma 3's q/k norm: by 1 + w
        qk = apply_rope(rms_norm_one_plus(x[:, : (heads + kv_heads) * dim].view(
            tokens, heads + kv_heads, dim), norm, 1e-6), cos, sin)  # fmt: skip
        q, k, _ = ops.qkv_rope(qkv, b, norm, cos, sin, heads, kv_heads, 1e-6, 1.0)
        torch.testing.assert_close(q, qk[:, :heads])
        torch.testing.assert_close(k, qk[:, heads:])


def test_silu_mul_matches_torch():
    gate_up = (torch.randn(3, 2 * 1536, generator=torch.Generator().manual_seed(3)) * 3).to(
        torch.bfloat16
    )
    gate, up = gate_up.float().chunk(2, dim=-1)
    want = (F.silu(gate) * up).to(torch.bfloat16)
    torch.testing.assert_close(ops.silu_mul_bf16(gate_up), want, atol=0, rtol=1e-2)


def _int8_cache(num_blocks, block_size, kv_heads, dim, gen, torch_writes=False):
    """A one-layer int8 pool filled with random K/V (scaled rows: outlier channels too)."""
    spec = KVSpec(1, kv_heads, dim, block_size, "int8")
    # torch_writes: kv_quant's torch arithmetic instead of the C++ op
    cache = make_kv_cache(spec, num_blocks, use_kernels=not torch_writes)
    slots = torch.arange(num_blocks * block_size)
    k = torch.randn(len(slots), kv_heads, dim, generator=gen)
    k[..., 3] *= 20  # an outlier channel, as real keys have
    v = torch.randn(len(slots), kv_heads, dim, generator=gen)
    cache.write(0, slots, k, v)
    return cache


def test_int8_kv_writes_the_same_bytes_from_cpp_and_torch():
    caches = [_int8_cache(6, 16, 3, 64, torch.Generator().manual_seed(9), torch_writes=t)
              for t in (False, True)]  # fmt: skip
    assert caches[0].use_kernels and not caches[1].use_kernels
    assert torch.equal(caches[0].raw, caches[1].raw)


@pytest.mark.parametrize(
    "heads,kv_heads,dim,block_size", [(9, 3, 64, 16), (4, 1, 32, 8), (6, 2, 20, 4)]
)  # head_dim 20: the per-head path (the group kernels take multiples of 32)
@pytest.mark.parametrize("lengths", [[1], [2100], [300, 5, 64, 1]])
def test_paged_int8_attention_matches_sdpa_over_the_dequantized_blocks(
    heads, kv_heads, dim, block_size, lengths
):
    gen = torch.Generator().manual_seed(len(lengths) * 7 + dim)
    num_blocks = 4 + sum(-(-n // block_size) for n in lengths)
    cache = _int8_cache(num_blocks, block_size, kv_heads, dim, gen)
    all_blocks = torch.arange(num_blocks).unsqueeze(0)
    k_deq, v_deq = (x.view(num_blocks, block_size, kv_heads, dim)
                    for x in cache.gather(0, all_blocks))  # fmt: skip
    tables = _scattered_tables(lengths, block_size, num_blocks, gen)
    q = torch.randn(len(lengths), heads, dim, generator=gen) * 3
    lens = torch.tensor(lengths)
    got = ops.paged_decode_attention_int8(q, cache.k_blocks[0], cache.v_blocks[0], tables, lens,
                                          dim**-0.5, block_size)  # fmt: skip
    want = _reference(q, k_deq, v_deq, tables, lens)
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)


def _q4_reference(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """The int4 x int8 product in float64 from the same roundings: activations quantized per
    block of 32 exactly as the kernel does (float32 `127 / max|x|`, round to nearest), then
    the exact sum of the dequantized products."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))  # float32, as the kernel
    codes = torch.round(blocks * inv).double()
    x_deq = (codes * (amax / 127).double()).reshape(x.shape)
    return x_deq @ weight.dequantize().double().t()


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (40, 64)])
def test_q4mm_matches_its_float64_reference_and_is_row_invariant(shape):
    """kvwise's int4 x int8 matmul: within float32 rounding of the float64 sum of the same
    quantized products (the block sums are exact integers), and each row's bits the same
    whatever the batch around it (4-row tiles and single rows run the same operations), so a
    prompt prefilled cold, a cached prefix plus its tail, and a decode step agree."""
    gen = torch.Generator().manual_seed(shape[0])
    weight = Int4Weight.quantize(torch.randn(*shape, generator=gen))
    x = torch.randn(301, shape[1], generator=gen) * 3
    x[5, :32] = 0  # an all-zero block
    full = ops.q4mm(x, weight.packed)
    want = _q4_reference(x, weight)
    scale = want.abs().max().item()
    assert (full.double() - want).abs().max().item() <= 1e-5 * scale
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 17, 64):
        for start in (0, 1, 5):
            assert torch.equal(ops.q4mm(x[start : start + rows], weight.packed),
                               full[start : start + rows]), (rows, start)  # fmt: skip


def _cpu_has_vnni() -> bool:
    with open("/proc/cpuinfo") as info:
        flags = next((line for line in info if line.startswith("flags")), "")
    return {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= set(flags.split())


def _cpu_has_amx() -> bool:
    with open("/proc/cpuinfo") as info:
        flags = next((line for line in info if line.startswith("flags")), "")
    return {"amx_tile", "amx_int8"} <= set(flags.split())


@pytest.mark.skipif(not _cpu_has_vnni(), reason="n/a: this CPU has no AVX-512 VNNI")
@pytest.mark.parametrize("shape", [(960, 576), (40, 64), (24, 64), (49152 // 32, 576)])
def test_avx512_vnni_and_amx_block_matmuls_give_the_avx2_bits(shape):
    """The VNNI code (two column groups a vector, 8-row tiles, an odd last group on the AVX2
    code) and the AMX code (16-row tiles of one block's exact integer sums, from 16 rows on,
    the rows padded to whole tiles) sum the same exact integers and run the same float
    operations: same bits as the AVX2 code, for int4 and Q8_0 weights, at every row count. On a
    CPU with VNNI (and AMX) it is the default build: a CPU that has it and a build that does
    not fails here."""
    best = "amx" if _cpu_has_amx() else "avx512vnni"
    assert kernels.block_isa() == best, f"this CPU has {best}, the build does not"
    assert kernels.block_isas()[-1] == best
    gen = torch.Generator().manual_seed(shape[1])
    dense = torch.randn(*shape, generator=gen)
    try:
        for packed, op in ((Int4Weight.quantize(dense).packed, ops.q4mm),
                           (Q8Weight.quantize(dense).packed, ops.q8mm)):  # fmt: skip
            for rows in (1, 3, 8, 9, 15, 16, 23, 33, 64, 300):
                x = torch.randn(rows, shape[1], generator=gen) * 3
                kernels.block_isa("avx2")
                avx2 = op(x, packed)
                for isa in kernels.block_isas()[1:]:
                    kernels.block_isa(isa)
                    assert torch.equal(op(x, packed), avx2), (op, rows, isa)
    finally:
        kernels.block_isa(best)


def _shared_tables(lengths, block_size, gen):
    """Scattered blocks for each row; rows of equal table (the same first row's) share them."""
    order = torch.randperm(2 + sum(-(-n // block_size) for n in lengths), generator=gen)
    tables = torch.zeros(len(lengths), -(-max(lengths) // block_size), dtype=torch.long)
    used = 0
    for row, n in enumerate(lengths):
        count = -(-n // block_size)
        tables[row, :count] = order[used : used + count]
        used += count
    return tables, len(order)


@pytest.mark.skipif(not _cpu_has_vnni(), reason="n/a: this CPU has no AVX-512 VNNI")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8"])
def test_avx512_paged_attention_gives_the_avx2_bits(dtype):
    """The AVX-512 build's paged attention runs each AVX2 lane's chain in a lane of its own
    (scores: two query vectors a register; weighted sums: 16 channels a register): the same
    bits as the AVX2 chains for decode rows, rows over shared prefix blocks and a prefill
    chunk's rows, every KV dtype, GQA group sizes 1 to 8, head sizes 32 to 256, with a window
    and with a soft cap."""
    assert kernels.attention_isa() == "avx512", "this CPU has AVX-512, the build does not"
    gen = torch.Generator().manual_seed(11)
    bs = 16
    # rows: decodes of assorted lengths, then three over the first decode's blocks (a shared
    # prefix), then a prefill chunk's rows (positions 290 .. 299 of that sequence)
    lengths = [300, 1, 17, 33, 64, 5, 299, 280, 300] + list(range(291, 301))
    try:
        for heads, kv_heads, dim in ((9, 3, 64), (8, 1, 128), (4, 4, 32), (16, 2, 256), (6, 2, 96)):
            own, num_blocks = _shared_tables(lengths[:6], bs, gen)
            tables = torch.cat([own, own[:1].expand(len(lengths) - 6, -1)])
            cache = make_kv_cache(KVSpec(1, kv_heads, dim, bs, dtype), num_blocks, torch.float32)
            slots = torch.arange(num_blocks * bs)
            cache.write(0, slots, torch.randn(len(slots), kv_heads, dim, generator=gen) * 2,
                        torch.randn(len(slots), kv_heads, dim, generator=gen))  # fmt: skip
            q = torch.randn(len(lengths), heads, dim, generator=gen)
            lens = torch.tensor(lengths)
            args = (q, cache.k_blocks[0], cache.v_blocks[0], tables, lens, dim**-0.5)
            if dtype == "int8":
                op, args = ops.paged_decode_attention_int8, (*args, bs)
            else:
                op = ops.paged_decode_attention
            for kind in ({}, {"window": 40}, {"softcap": 30.0}):
                kernels.attention_isa("avx2")
                want = op(*args, **kind)
                kernels.attention_isa("avx512")
                assert torch.equal(op(*args, **kind), want), (heads, kv_heads, dim, kind)
    finally:
        kernels.attention_isa("avx512")


@pytest.mark.skipif(not _cpu_has_vnni() or _cpu_has_amx(), reason="n/a: tested above")
def test_a_cpu_with_vnni_and_without_amx_refuses_amx():
    assert "amx" not in kernels.block_isas()
    with pytest.raises(RuntimeError, match="no AMX kernels"):
        kernels.block_isa("amx")
    assert kernels.block_isa() == "avx512vnni"


@pytest.mark.skipif(_cpu_has_vnni(), reason="n/a: this CPU has AVX-512 VNNI (tested above)")
def test_a_cpu_without_vnni_runs_the_avx2_code_and_refuses_vnni():
    assert kernels.block_isa() == "avx2"
    assert kernels.block_isas() == ["avx2"]
    with pytest.raises(RuntimeError, match="no AVX-512 VNNI kernels"):
        kernels.block_isa("avx512vnni")
    with pytest.raises(RuntimeError, match="no AMX kernels"):
        kernels.block_isa("amx")
    assert kernels.block_isa() == "avx2"
    assert kernels.attention_isa() == "avx2"
    with pytest.raises(RuntimeError, match="no AVX-512 attention"):
        kernels.attention_isa("avx512")


def test_block_isa_refuses_an_unknown_name():
    with pytest.raises(RuntimeError, match="expected 'avx2', 'avx512vnni' or 'amx'"):
        kernels.block_isa("sse2")


def test_q4mm_refuses_mismatched_shapes():
    weight = Int4Weight.quantize(torch.randn(16, 64))
    with pytest.raises(RuntimeError, match="packed must be"):
        ops.q4mm(torch.randn(2, 96), weight.packed)
    with pytest.raises(RuntimeError, match="float32"):
        ops.q4mm(torch.randn(2, 64).to(torch.bfloat16), weight.packed)


@pytest.mark.parametrize("rows,vocab,k", [(1, 49152, 64), (16, 1000, 64), (3, 70, 70), (2, 9, 1)])
def test_top_k_ids_finds_the_same_set_as_torch_topk(rows, vocab, k):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(rows, vocab, generator=gen) * 3
    ids = ops.top_k_ids(x, k)
    want = x.topk(k, dim=-1).indices
    assert torch.equal(ids.sort(-1).values, want.sort(-1).values)


def test_top_k_ids_refuses_a_k_beyond_the_row():
    with pytest.raises(RuntimeError, match="k must be in 1..8"):
        ops.top_k_ids(torch.randn(2, 8), 9)


def test_greedy_pick_is_torch_argmax_and_log_softmax():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 49152 + 5, generator=gen) * 4
    x[1, 10] = x[1, 4000] = x[1].max() + 1  # a tie: the first id, as torch.argmax
    x[2, 77] = float("nan")  # NaN wins, as in torch.argmax
    ids, logprobs = ops.greedy_pick(x)
    assert torch.equal(ids, x.argmax(-1))
    want = torch.log_softmax(x, -1).gather(1, ids[:, None])[:, 0]
    assert torch.allclose(logprobs[[0, 1, *range(3, 16)]], want[[0, 1, *range(3, 16)]], atol=1e-5)
