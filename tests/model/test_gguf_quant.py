"""A GGUF file's tensors in their own types (kvserve/model/quant/gguf_types.py, the default on a .gguf
file): unpacked Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q5_K/Q8_0 blocks give gguf's dequantized values bit for bit, on
written and real files; native loads hold the dequantized load's values; engines on both agree;
resident bytes; SmolLM2 Q4_1 answers natively."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve import LLM, kernels
from kvserve.config import EngineConfig
from kvserve.model.fusion import linear_weight
from kvserve.model.loaders.gguf import load_gguf
from kvserve.model.quant.gguf_types import UNPACK_INT4, UNPACK_INT5, unpack_q4_k, unpack_q5_k, unpack_q6_k, unpack_q8_0
from kvserve.model.quant import cpu_paths
from kvserve.model.quant.cpu_paths import kernel_plan
from kvserve.model.quant.formats import Int4Weight, Int8Weight, keeps_quantized
from kvserve.model.quant.gguf_blocks import Int4Values, Int8BlockWeight
from tests.kernels.test_linear_ops import q16_activations
from tests.model.gguf_files import quantize_q4_k, random_k_quant, write_hf_as_gguf, write_mixed_types
from tests.model.test_gguf_tokenizer import SMOLLM2, needs_smollm2
from tests.model.test_quant import greedy, teacher_forced

gguf = pytest.importorskip("gguf")


def bits(a: np.ndarray) -> np.ndarray:
    """float32 bits, zeros as +0.0: Q5_0's d (q - 16) is -0.0 at q = 16 where d < 0, kvserve's
    d (q - 8) - 8 d +0.0 (the same value)."""
    return (np.ascontiguousarray(a, dtype=np.float32) + np.float32(0)).view(np.int32)


def int4_values(q, scale, zero) -> np.ndarray:
    """(q - 8) * scale + zero in float32, as numpy computes it: the reference form."""
    N, K = q.shape
    w = (q.reshape(N, -1, 32).astype(np.float32) - np.float32(8)) * scale[..., None]
    return (w if zero is None else w + zero[..., None]).reshape(N, K)


def q8_values(q, d) -> np.ndarray:
    N, K = q.shape
    return (q.reshape(N, -1, 32).astype(np.float32) * d[..., None]).reshape(N, K)


def sample_weights(n: int = 128, k: int = 512, seed: int = 0) -> np.ndarray:
    """Gaussian rows over three decades of scale, a zero row, an all-positive row, an outlier."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n, k)) * np.logspace(-3, 0, n)[:, None]
    a[3], a[7], a[5, 17] = 0.0, np.abs(a[7]), 5.0
    return a.astype(np.float32)


def encode(a: np.ndarray, qtype: str) -> np.ndarray:
    if qtype == "Q4_K":
        return quantize_q4_k(a)       # gguf-py cannot write K-quants
    return gguf.quants.quantize(a, gguf.GGMLQuantizationType[qtype])


def unpacked_values(raw: np.ndarray, qtype: str, N: int, K: int) -> np.ndarray:
    if qtype == "Q8_0":
        return q8_values(*unpack_q8_0(raw, N, K))
    return int4_values(*{**UNPACK_INT4, **UNPACK_INT5}[qtype](raw, N, K))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q8_0"])
def test_unpacked_blocks_equal_gguf_dequantize_bit_for_bit(qtype):
    a = sample_weights()
    raw = encode(a, qtype)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    assert np.array_equal(bits(unpacked_values(raw, qtype, *a.shape)), bits(ref))
    if qtype != "Q8_0":   # Int4Values computes the same in torch
        q, scale, zero = {**UNPACK_INT4, **UNPACK_INT5}[qtype](raw, *a.shape)
        assert q.max() == (31 if qtype.startswith("Q5") else 15)
        values = Int4Values(*[None if x is None else torch.from_numpy(x) for x in (q, scale, zero)])
        assert np.array_equal(bits(values.dequantize().numpy()), bits(ref))


def test_q4_k_any_bits_and_the_zero_point_rounding():
    """Random bytes (every 6-bit scale and min, every nibble) with d and dmin drawn apart: bit
    for bit while 8 d sc and dmin m are within a few powers of two of each other (then the zero
    8 d sc - dmin m is exact in float32; llama.cpp derives d and dmin from the same weights, and
    the realistic blocks above are exact). Drawn decades apart, the zero is rounded once in
    float32, which moves a weight by at most an ulp of the zero: 2^-23 of it."""
    rng = np.random.default_rng(1)
    N, K = 64, 1024
    for spread, exact in ((1, True), (4, False)):
        blocks = rng.integers(0, 256, size=(N * K // 256, 144), dtype=np.uint8)
        scales = (10.0 ** rng.uniform(-2 - spread, -2, size=(len(blocks), 2))).astype(np.float16)
        blocks[:, 0:4] = scales.view(np.uint8)
        raw = blocks.reshape(N, -1)
        ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)
        q, scale, zero = unpack_q4_k(raw, N, K)
        got = int4_values(q, scale, zero)
        same = bits(got) == bits(ref)
        assert same.all() == exact
        ulp_zero = np.spacing(np.abs(zero)).repeat(32, axis=1)
        assert (np.abs(got - ref) <= ulp_zero + np.spacing(np.abs(ref))).all()


def test_q5_k_any_bits():
    """Q5_K from random bytes (every fifth bit, nibble, 6-bit scale and min), d and dmin within a
    decade: the fifth bits of sub-block j are bit j of the 32 qh bytes, bit for bit gguf's values."""
    rng = np.random.default_rng(2)
    N, K = 32, 512
    blocks = rng.integers(0, 256, size=(N * K // 256, 176), dtype=np.uint8)
    blocks[:, 0:4] = (10.0 ** rng.uniform(-3, -2, size=(len(blocks), 2))).astype(np.float16).view(np.uint8)
    raw = blocks.reshape(N, -1)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_K)
    q, scale, zero = unpack_q5_k(raw, N, K)
    assert q.max() == 31 and np.array_equal(bits(int4_values(q, scale, zero)), bits(ref))


def test_q6_k_any_bits():
    """Q6_K from random bytes (every low nibble, high bit pair and signed scale), d over three
    decades: q in -32..31 and q * d the gguf value, d (d_super * sc, exact in float32) rounded to
    float16: within 2^-11 of each weight."""
    rng = np.random.default_rng(3)
    N, K = 24, 512
    blocks = random_k_quant(N, K, "Q6_K", rng).reshape(-1, 210)
    blocks[:, 208:210] = (10.0 ** rng.uniform(-5, -2, size=(len(blocks), 1))).astype(np.float16).view(np.uint8)
    raw = blocks.reshape(N, -1)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K)
    q, d = unpack_q6_k(raw, N, K)
    assert q.dtype == np.int8 and (q.min(), q.max()) == (-32, 31) and d.shape == (N, K // 16)
    assert np.array_equal(d, d.astype(np.float16).astype(np.float32))
    got = (q.reshape(N, -1, 16).astype(np.float64) * d[..., None]).reshape(N, K)
    assert (np.abs(got - ref) <= 2.0 ** -11 * np.abs(ref)).all()
    assert np.abs(got - ref).max() > 0              # the float16 rounding is real: not the gguf values


def test_int5_needs_kvserves_kernels(monkeypatch):
    """A fifth bit is read by kvserve's kernels only: without them an int5 weight is refused
    (and a GGUF file's Q5 tensors are requantized to int8 instead: test_native_load_of_q5)."""
    monkeypatch.setattr(kernels, "available", lambda device="cpu": False)
    q = torch.randint(0, 32, (16, 64), dtype=torch.uint8)
    with pytest.raises(ValueError, match="5-bit weights run on kvserve's CPU kernels only"):
        Int4Weight(q, torch.ones(16, 2), torch.zeros(16, 2))


@needs_smollm2
def test_smollm2_blocks_bit_for_bit():
    """The real file: its Q4_1 layers and Q8_0 embedding (first 4096 rows) decode exactly."""
    reader = gguf.GGUFReader(SMOLLM2)
    tensors = {t.name: t for t in reader.tensors}
    names = [f"blk.{i}.{n}.weight" for i in (0, 29) for n in
             ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")]
    for name in names + ["token_embd.weight"]:
        t = tensors[name]
        raw = t.data[:4096]
        K = int(t.shape[0])
        qtype = t.tensor_type.name
        assert qtype == ("Q8_0" if name == "token_embd.weight" else "Q4_1")
        ref = gguf.quants.dequantize(raw, t.tensor_type)
        assert np.array_equal(bits(unpacked_values(raw, qtype, raw.shape[0], K)), bits(ref)), name


def linear_parts(weights: dict) -> dict:
    return {k: v for k, v in weights.items() if k.endswith("proj.weight") or "embed" in k or "lm_head" in k}


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_native_load_holds_the_dequantized_values(qtype, random_model_dir, tmp_path):
    """Every Q4 matrix loads as Int4Values whose values are the dequantized load's, bit for bit,
    q_proj and k_proj included (their rows un-permuted alike in q, scale and zero)."""
    path = write_hf_as_gguf(random_model_dir("llama"), tmp_path / "m.gguf", qtype)
    _, native, _ = load_gguf(path, native=True)
    _, ref, _ = load_gguf(path)
    assert native.keys() == ref.keys()
    for name, w in native.items():
        if name in linear_parts(native):
            assert isinstance(w, Int4Values) and (w.values()[2] is None) == (qtype == "Q4_0"), name
            w = w.dequantize()
        assert torch.equal(w.view(torch.int32), ref[name].view(torch.int32)), name


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1"])
@pytest.mark.parametrize("own", [True, False])
def test_native_load_of_q5(qtype, own, random_model_dir, tmp_path, monkeypatch):
    """With kvserve's kernels every Q5 matrix loads as Int4Values with q in 0..31, the dequantized
    load's values bit for bit; packed, a fifth-bit plane of K / 8 bytes a row beside the nibbles.
    Without them (monkeypatched off) each is requantized to per-row int8."""
    if own and not kernels.available():
        pytest.skip("kvserve's kernels are not built here")
    monkeypatch.setattr(kernels, "available", lambda device="cpu": own)
    path = write_hf_as_gguf(random_model_dir("llama"), tmp_path / "m.gguf", qtype)
    _, native, _ = load_gguf(path, native=True)
    _, ref, _ = load_gguf(path)
    for name, w in linear_parts(native).items():
        if not own:
            assert isinstance(w, Int8Weight), name
            continue
        assert isinstance(w, Int4Values) and int(w.values()[0].max()) > 15, name
        assert torch.equal((w.dequantize() + 0).view(torch.int32), (ref[name] + 0).view(torch.int32)), name   # bits.__doc__
        packed = w.pack(torch.float32, "cpu")
        N, K = w.shape
        assert packed.high.shape == (N, K // 8) and torch.equal(packed.q_values(), w.values()[0])


def test_native_q8_0(random_model_dir, tmp_path):
    """With kvserve's kernels every Q8_0 matrix stays Q8_0 (Int8BlockWeight: q * d exactly, q/k
    rows un-permuted with their d). Without them the layer matrices are requantized per row
    (error within half a step) and the embedding and lm_head kept on two int4 planes (d rounded
    to bfloat16, within 2^-8 of each weight)."""
    path = write_hf_as_gguf(random_model_dir("llama"), tmp_path / "m.gguf", "Q8_0")
    _, native, _ = load_gguf(path, native=True)
    _, ref, _ = load_gguf(path)
    own = kernels.available("cpu")
    for name, w in linear_parts(native).items():
        if own or name in ("model.embed_tokens.weight", "lm_head.weight"):
            assert isinstance(w, Int8BlockWeight), name
            got = w.rows(torch.arange(w.shape[0]))
            tol = 0 if own else 2 ** -8
            assert ((got - ref[name]).abs() <= tol * ref[name].abs()).all(), name
            continue
        assert isinstance(w, Int8Weight), name
        s = w.scale.double()[:, None]
        err = (w.q.double() * s - ref[name].double()).abs()
        assert (err <= s / 2 * (1 + 1e-5)).all(), name


@pytest.mark.parametrize("rows", [1, 5, 8, 200])   # the GEMV, the tile, and past the plan's rows dequantization
@pytest.mark.parametrize("own", [True, False])     # kvserve's Q8_0 kernel, or two int4 planes for torch's
def test_int8_block_weight_computes_x_times_w(rows, own, monkeypatch):
    if own and not kernels.available("cpu"):
        pytest.skip("kvserve's kernels are not built here")
    if not own:
        monkeypatch.setattr(kernels, "available", lambda device="cpu": False)
    a = sample_weights(128, 256)
    q, d = unpack_q8_0(gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0), 128, 256)
    w = Int8BlockWeight(torch.from_numpy(q), torch.from_numpy(d))
    stored = torch.from_numpy(d) if own else torch.from_numpy(d).bfloat16().float()    # planes: d in bf16
    exact = torch.from_numpy(q8_values(q, stored.numpy())).double()
    assert torch.equal(w.dequantize().double(), exact)                  # q * d (two planes add up exactly)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(0))
    ref = x.double() @ exact.T
    got = w.linear(x)
    amx = own and 0 < torch.ops.kvserve.amx_rows() <= rows                 # AMX tiles: bf16 operands
    tol = 1e-5 if own and rows <= w.kernel_max_rows and not amx else 1e-2  # float32 kernel; else a bf16 GEMM at most
    if own and rows <= kernels.KERNEL_ROWS:       # the int16 route: x in int16 per 32 (tests/kernels: its bound)
        ref = q16_activations(x) @ exact.T
    assert got.shape == (rows, 128) and (got.double() - ref).abs().max() <= tol * ref.abs().max()
    assert w.nbytes == (128 * 256 + 128 * 8 * 2 if own else int4_bytes(128, 512))   # q + float16 d, or two planes
    assert [torch.equal(a, b) for a, b in zip(w.values(), (torch.from_numpy(q), stored))] == [True, True]


def test_int8_blocks_of_16_and_32_fuse_into_blocks_of_16():
    """A Q8_0 part beside a Q6_K one (Q4_K_M's q, k and v): one weight of 16-weight blocks, each
    Q8_0 d repeated, the same values; the kernels' product of it is x times those values."""
    if not kernels.available("cpu"):
        pytest.skip("kvserve's kernels are not built here")
    g = torch.Generator().manual_seed(1)
    q32, q16 = (torch.randint(-128, 128, (n, 64), generator=g, dtype=torch.int8) for n in (8, 5))
    d32 = (torch.rand(8, 2, generator=g) * 0.01).half().float()
    d16 = (torch.rand(5, 4, generator=g) * 0.01).half().float()
    parts = [Int8BlockWeight(q32, d32), Int8BlockWeight(q16, d16)]
    w = Int8BlockWeight.cat(parts, torch.float32, "cpu")
    assert w.block == 16 and w.shape == (13, 64)
    exact = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(w.dequantize(), exact)
    x = torch.randn(2, 64, generator=g)
    if w.kernel_max_rows >= 2:                             # two rows: the int16 route
        ref, tol = q16_activations(x) @ exact.double().T, 1e-5
    else:                                                  # a plan that dequantizes (DEFAULT)
        ref, tol = x.double() @ exact.double().T, 1e-2
    assert (w.linear(x).double() - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("other", ["Q5_0", "Q4_0", "Q4_1"])
def test_mixed_parts_fuse_into_int8_blocks_where_their_values_allow(other):
    """Q4_K_M's q and k (Q5_0) with its v (Q8_0): one Int8BlockWeight of the same values, bit for
    bit (Q5_0 and Q4_0 are d times integers); a part with a min (Q4_1) cannot, and the whole
    matrix is per-row int8 as before."""
    if not kernels.available("cpu"):
        pytest.skip("kvserve's kernels are not built here")
    a = sample_weights(64, 256)
    arrays = {**UNPACK_INT4, **UNPACK_INT5}[other](encode(a[:40], other), 40, 256)
    part = Int4Values(*[None if x is None else torch.from_numpy(x) for x in arrays])
    v = Int8BlockWeight(*[torch.from_numpy(x) for x in unpack_q8_0(encode(a[40:], "Q8_0"), 24, 256)])
    w = linear_weight([part, v], "qkv", None, None, torch.device("cpu"), torch.float32)
    exact = torch.cat([part.dequantize(), v.dequantize()])
    if not keeps_quantized("cpu"):          # this CPU's plan holds every weight dequantized
        assert isinstance(w, torch.Tensor)
        if other != "Q4_1":
            assert torch.equal((w + 0).view(torch.int32), (exact + 0).view(torch.int32))
        return
    if other == "Q4_1":
        assert isinstance(w, Int8Weight)
        return
    assert isinstance(w, Int8BlockWeight) and w.block == 32
    assert torch.equal((w.dequantize() + 0).view(torch.int32), (exact + 0).view(torch.int32))    # bits.__doc__


# Native against quantization="dequant" on the same file, teacher-forced over the dequantized
# run's greedy tokens (6 prompts x 16): (min top-1 agreement, max mean KL). What differs: scales
# and zeros in bfloat16 and bfloat16 matmuls (int4), per-row int8 (Q8_0 and Q5 layers without kvserve's
# kernels, and the mixed file's Q6/Q2/Q3_K), the mixed file's q/k/v fused as int8 (Q4_K + Q3_K + Q2_K).
# Measured (1 thread): Q4_0 top-1 0.979, KL 0.00014; Q4_1 0.969, 0.00016; Q8_0 0.969, 0.00041;
# Q4_K 1.000, 0.00056; mixed 0.990, 0.00006. With the Q5 types held as int5 (gate Q5_0 + up Q5_1 no
# longer int8): Q5_0 0.958, 0.00014; mixed 1.000, 0.00003 (2026-12-07). Q6_K in blocks of 16 on the kernels
# (the mixed file's embedding too): Q6_K 1.000, KL under 0.000005; mixed 1.000, 0.00001. The random weights' top-1 margins are small (see
# test_quant.py), so one flip changes the rest of a greedy run: whole runs are not compared.
AGREEMENT = {"Q4_0": (0.9, 0.003), "Q4_1": (0.9, 0.003), "Q8_0": (0.9, 0.003), "Q4_K": (0.9, 0.003),
             "Q5_0": (0.9, 0.003), "Q6_K": (0.9, 0.003), "mixed": (0.9, 0.003)}
ALL_TENSORS = ("token_embd.weight", "output.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight",
               "blk.0.attn_v.weight", "blk.0.attn_output.weight", "blk.0.ffn_gate.weight",
               "blk.0.ffn_up.weight", "blk.0.ffn_down.weight")   # the mixed file's, all in one type


def gguf_file(qtype: str, random_model_dir, path):
    if qtype in ("mixed", "Q4_K", "Q6_K"):
        return write_mixed_types(path, types={n: qtype for n in ALL_TENSORS} if qtype != "mixed" else None)
    return write_hf_as_gguf(random_model_dir("llama"), path, qtype)


@pytest.mark.parametrize("qtype", list(AGREEMENT))
def test_native_engine_tracks_the_dequantized_one(qtype, random_model_dir, tmp_path):
    path = str(gguf_file(qtype, random_model_dir, tmp_path / "m.gguf"))
    rng = np.random.default_rng(7)
    prompts = [[1] + rng.integers(3, 512, size=rng.integers(4, 40)).tolist() for _ in range(6)]
    ref_llm = LLM(path, quantization="dequant")
    ref = greedy(ref_llm, prompts)
    llm = LLM(path, max_num_seqs=1, max_num_batched_tokens=64)   # decodes on the kernels
    out = greedy(llm, prompts)
    top1, kl = teacher_forced(llm.engine.model, ref_llm.engine.model, prompts, ref)
    same = sum(a == b for a, b in zip(out, ref))
    print(f"{qtype}: top-1 {top1:.3f}, KL {kl:.5f}, {same}/6 greedy runs identical")
    min_top1, max_kl = AGREEMENT[qtype]
    assert top1 >= min_top1 and kl <= max_kl, (top1, kl)
    layer = llm.engine.model.layers[0]
    kinds = {name: type(getattr(layer, name)).__name__ for name in ("qkv", "o", "gate_up", "down")}
    own = kernels.available()
    expect = {"Q4_0": "Int4Weight", "Q4_1": "Int4Weight", "Q4_K": "Int4Weight",
              "Q5_0": "Int4Weight" if own else "Int8Weight",
              "Q8_0": "Int8BlockWeight" if own else "Int8Weight",
              "Q6_K": "Int8BlockWeight" if own else "Int8Weight"}
    if not keeps_quantized("cpu"):      # this CPU's plan holds every weight dequantized
        assert set(kinds.values()) == {"Tensor"}
    elif qtype in expect:
        assert set(kinds.values()) == {expect[qtype]}
        logits_side = "Int8BlockWeight" if qtype == "Q8_0" else expect[qtype]
        assert {type(llm.engine.model.embed).__name__, type(llm.engine.model.lm_head).__name__} == {logits_side}
    else:   # q Q4_K + k Q3_K + v Q2_K -> int8; o BF16, down F16 -> the dtype; gate Q5_0 + up Q5_1 -> int5
        assert kinds == {"qkv": "Int8Weight", "o": "Tensor", "gate_up": "Int4Weight" if own else "Int8Weight",
                         "down": "Tensor"}
        embed = llm.engine.model.embed                                  # Q6_K: blocks of 16 on the kernels
        assert type(embed).__name__ == ("Int8BlockWeight" if own else "Int8Weight")
        assert not own or embed.block == 16


def int4_bytes(n: int, k: int) -> int:
    """The nibbles and a bfloat16 scale and zero per group of 32; where kvserve's kernels are not
    built and this CPU's plan runs torch's int4 kernel, its packed nibbles and its scales again."""
    base = n * k // 2 + n * k // 32 * 4
    if kernel_plan().int4_kernel_max_rows < 0 or kernels.available():
        return base
    return 2 * base


def test_resident_bytes_of_a_q4_0_file(random_model_dir, tmp_path):
    """hidden 64, intermediate 128, 2 layers, vocab 512, untied: every matrix int4 g32."""
    path = str(write_hf_as_gguf(random_model_dir("llama"), tmp_path / "m.gguf", "Q4_0"))
    shapes = [(128, 64), (64, 64), (256, 64), (64, 128)] * 2 + [(512, 64), (512, 64)]
    norms = 5 * 64 * 4
    native = LLM(path).engine.model.weight_bytes()
    dequant = LLM(path, quantization="dequant").engine.model.weight_bytes()
    assert dequant == sum(n * k for n, k in shapes) * 4 + norms
    assert native == (sum(int4_bytes(n, k) for n, k in shapes) + norms if keeps_quantized("cpu") else dequant)


def test_explicit_methods_on_a_gguf_file(random_model_dir, tmp_path):
    """int4 keeps a Q4 file's int4 weights as they are (group 32); int4-g128 and int8 requantize."""
    path = str(write_hf_as_gguf(random_model_dir("llama"), tmp_path / "m.gguf", "Q4_1"))
    native = LLM(path).engine.model.layers[0].gate_up
    same = LLM(path, quantization="int4").engine.model
    if not keeps_quantized("cpu"):      # held dequantized: the same values
        assert torch.equal(same.layers[0].gate_up, native)
        return
    assert same.layers[0].gate_up.group_size == 32
    assert torch.equal(same.layers[0].gate_up.nibbles, native.nibbles)
    assert isinstance(same.embed, torch.Tensor)          # explicit methods: embedding in the dtype
    assert LLM(path, quantization="int4-g64").engine.model.layers[0].gate_up.group_size == 64
    assert isinstance(LLM(path, quantization="int8").engine.model.layers[0].gate_up, Int8Weight)
    with pytest.raises(ValueError, match="needs quantization"):
        EngineConfig(model=path, quantization="dequant", quantization_group_size=32)


def test_a_quantized_gguf_file_keeps_its_kv_cache_in_bfloat16(random_model_dir, tmp_path):
    """kv_cache_dtype auto for a GGUF file of quantized weights run in float32: bfloat16 (as
    llama.cpp keeps float16: half the bytes a decode step reads); float32 keeps the model's own, as
    do a float GGUF file and dequant (exact weights); float32 for a bfloat16 model refused."""
    def cache(path, **kw):
        return {t.dtype for t in LLM(path, num_kv_blocks=8, **kw).engine.core.runner.kv_cache_tensors()}
    q4 = str(write_hf_as_gguf(random_model_dir("llama"), tmp_path / "q.gguf", "Q4_1"))
    f32 = str(write_hf_as_gguf(random_model_dir("llama"), tmp_path / "f.gguf", "F32"))
    assert cache(q4) == {torch.bfloat16}
    assert cache(q4, kv_cache_dtype="float32") == cache(q4, quantization="dequant") == cache(f32) == {torch.float32}
    with pytest.raises(ValueError, match="kv_cache_dtype float32 keeps a float32 model"):
        LLM(q4, dtype="bfloat16", kv_cache_dtype="float32")


def test_rows_the_int4_kernel_cannot_take_run_dequantized(caplog):
    """A (fused) matrix whose rows are not a multiple of 16 stays int4: kvserve's kernels take
    any row count; where only torch's is there, on the dequantize path (one warning for the
    shape), with the same values; two of them fused fit torch's kernel."""
    a = sample_weights(72, 64)
    q, scale, zero = UNPACK_INT4["Q4_1"](gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q4_1), 72, 64)
    values = Int4Values(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(zero))
    cpu_paths._warned.clear()
    with caplog.at_level("WARNING"):
        w = values.pack(torch.float32, "cpu")
        values.pack(torch.float32, "cpu")
    own = kernels.available("cpu")
    assert isinstance(w, Int4Weight) and w.packed is None
    assert w.kernel_max_rows == (kernel_plan().int4_kernel_max_rows if own else -1)
    warned = sum("divisible by 16" in r.getMessage() for r in caplog.records)
    assert warned == (1 if kernel_plan().int4_kernel_max_rows >= 0 and not own else 0)
    exact = values.dequantize().double()
    assert (w.dequantize(dtype=torch.float32).double() - exact).abs().max() <= 2 ** -7 * exact.abs().max()
    x = torch.randn(3, 64)
    ref = x.double() @ w.dequantize(dtype=torch.float32).double().T
    assert (w.linear(x).double() - ref).abs().max() <= 1e-2 * ref.abs().max()   # a bf16 GEMM at most
    fused = Int4Values.cat([values, values]).pack(torch.float32, "cpu")
    assert isinstance(fused, Int4Weight) and fused.kernel_max_rows == kernel_plan().int4_kernel_max_rows


@needs_smollm2
def test_smollm2_q4_1_natively():
    """The default model in its own types: int4 layers, the Q8_0 embedding (the tied lm_head)
    exact in its own type (96.5 MB resident, the file's 98.4 MB; without kvserve's kernels on two
    int4 planes, 102 MB) against 538 MB dequantized to float32; Paris."""
    from kvserve import SamplingParams

    llm = LLM(str(SMOLLM2), max_model_len=256, kv_cache_memory=16 << 20)
    model = llm.engine.model
    E, I, V, L = 576, 1536, 49152, 30
    layer_shapes = [(960, E), (E, E), (2 * I, E), (E, I)]
    dequantized = (L * sum(n * k for n, k in layer_shapes) + V * E + (2 * L + 1) * E) * 4
    if keeps_quantized("cpu"):
        assert isinstance(model.embed, Int8BlockWeight) and model.lm_head is model.embed
        assert all(isinstance(w, Int4Weight) for layer in model.layers
                   for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
        embed = V * E + V * E // 32 * 2 if kernels.available() else int4_bytes(V, 2 * E)   # q + float16 d, or two planes
        expect = L * sum(int4_bytes(n, k) for n, k in layer_shapes) + embed + (2 * L + 1) * E * 4
    else:       # this CPU's plan holds the weights dequantized, in the model dtype (float32)
        assert isinstance(model.embed, torch.Tensor) and model.lm_head is model.embed
        expect = dequantized
    assert model.weight_bytes() == expect
    print(f"SmolLM2 resident weights: native {expect / 1e6:.1f} MB, dequantized {dequantized / 1e6:.1f} MB")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0]
    assert "Paris" in out.text, out.text


def test_smollm2_chunked_prefill_samples_nothing_in_its_first_chunks():
    """A prompt longer than the step's token budget: its first chunks sample nothing, so the tied
    Q8_0 lm_head (two int4 planes) sees 0 rows; that once failed the engine (a reshape of 0 rows),
    which took down a server given any prompt over max_num_batched_tokens. Now the chunked answer
    equals the unchunked one."""
    from kvserve import SamplingParams

    prompt = "Once upon a time, in a land far away, there lived a curious fox who loved to read " * 2
    params = SamplingParams(temperature=0.0, max_tokens=8)
    whole = LLM(str(SMOLLM2), max_model_len=256, kv_cache_memory=16 << 20).generate([prompt], params)
    chunked = LLM(str(SMOLLM2), max_model_len=256, kv_cache_memory=16 << 20, max_num_batched_tokens=16,
                  max_num_seqs=4).generate([prompt], params)
    assert len(chunked[0].prompt_token_ids) > 2 * 16
    assert chunked[0].outputs[0].token_ids == whole[0].outputs[0].token_ids
