"""The fused mixture-of-experts Triton kernels: run by triton's CPU interpreter against a per-expert torch loop,
built offline for sm_90 (H100/H200), and the expert-sorted slot layout they read."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import pytest
import torch

from tests.hopper_reports import build_launches, checked_report, hopper_reports_of, recording_kernels
from tests.triton_interpreter import interpreted_report

# Child processes, the Triton interpreter or offline GPU builds: left out of `make test-fast`.
pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Case:
    name: str
    tokens: int
    experts: int  # on this rank
    top_k: int
    hidden: int
    inter: int
    dtype: str
    ids: str = "int64"
    routing: str = "random"  # or "skewed": expert 0 in every token, expert 1 in one, the upper half in none
    remote_experts: int = 0  # routed to, but on another rank: their ids arrive as -1
    strided_hidden: bool = False  # hidden is a column slice of a wider buffer, as a fused projection leaves it
    bias: bool = False  # per-expert biases on both projections (gpt-oss)
    activation: str = "silu"  # or "swiglu_clamped": gpt-oss's, with gate/up large enough to hit its clamps


CASES = [
    Case("t1_top1_e8_fp32", 1, 8, 1, 64, 32, "float32"),
    Case("t1_top8_e128_odd_bf16", 1, 128, 8, 72, 40, "bfloat16", ids="int32"),
    Case("t24_top2_e8_skewed_fp16", 24, 8, 2, 72, 40, "float16", routing="skewed"),
    Case("t40_top8_e128_odd_bf16", 40, 128, 8, 72, 40, "bfloat16", ids="int32"),
    Case("t64_top8_e128_odd_fp16", 64, 128, 8, 40, 72, "float16"),
    Case("t17_top2_e16_remote_fp32", 17, 16, 2, 72, 40, "float32", remote_experts=16, strided_hidden=True),
    Case("t12_top8_e64_remote_bf16", 12, 64, 8, 40, 72, "bfloat16", remote_experts=64),
    Case("t9_top1_e8_remote_fp16", 9, 8, 1, 72, 40, "float16", ids="int32", remote_experts=8),
    # Several column blocks in both kernels and K loops of several steps, the last one partial.
    Case("t20_top2_e8_wide_fp16", 20, 8, 2, 200, 150, "float16"),
    Case("t48_top8_e8_bf16", 48, 8, 8, 72, 40, "bfloat16"),  # 32-row blocks
    Case("t96_top8_e8_remote_fp32", 96, 8, 8, 40, 24, "float32", remote_experts=2),  # 64-row blocks
    # gpt-oss's experts: biases and the clamped SwiGLU, alone, beside remote experts, over several blocks.
    Case("t24_top4_e32_swiglu_bias_fp32", 24, 32, 4, 64, 48, "float32", bias=True, activation="swiglu_clamped"),
    Case("t17_top4_e16_swiglu_bias_remote_bf16", 17, 16, 4, 72, 40, "bfloat16", remote_experts=16, bias=True,
         activation="swiglu_clamped"),
    Case("t80_top4_e8_swiglu_bias_fp16", 80, 8, 4, 200, 150, "float16", bias=True, activation="swiglu_clamped"),
    Case("t9_top2_e8_bias_silu_fp32", 9, 8, 2, 40, 24, "float32", bias=True),
]  # fmt: skip
# Largest |got - want| over a token's row, relative to the row's largest |want|. The GEMMs accumulate in fp32;
# the intermediate and the result are rounded to the dtype (bf16 truncated, not rounded, by the interpreter):
# about one unit in the last place for fp16, two for bf16 (units 4.9e-4 and 3.9e-3); fp32 sums in another order.
TOLERANCE = {"float32": 2e-6, "float16": 2e-3, "bfloat16": 2e-2}


def fused_experts_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """The same sum as triton_fused_experts, one expert at a time in float64; returns float64 [T, H]."""
    inter = w13.shape[1] // 2
    x = hidden.double()
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for expert in range(w13.shape[0]):
        tokens, slots = (topk_ids == expert).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate = x[tokens] @ w13[expert, :inter].double().T
        up = x[tokens] @ w13[expert, inter:].double().T
        if w13_bias is not None:
            gate, up = gate + w13_bias[expert, :inter].double(), up + w13_bias[expert, inter:].double()
        if activation == "swiglu_clamped":
            gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
            act = (up + 1) * gate * torch.sigmoid(1.702 * gate)
        else:
            act = torch.nn.functional.silu(gate) * up
        down = act @ w2[expert].double().T
        if w2_bias is not None:
            down = down + w2_bias[expert].double()
        out.index_add_(0, tokens, down * topk_weights[tokens, slots].double()[:, None])
    return out


def _routing(case: Case, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """topk ids over local + remote experts (remote ones → -1) and normalised weights."""
    total = case.experts + case.remote_experts
    if case.routing == "skewed":
        # Expert 0 gets every token (more than one row block), expert 1 exactly one, the upper half none.
        rest = [
            torch.randperm(case.experts // 2 - 2, generator=generator)[: case.top_k - 1] + 2 for _ in range(case.tokens)
        ]
        ids = torch.stack([torch.cat([torch.zeros(1, dtype=torch.int64), r]) for r in rest])
        ids[0, -1] = 1
    else:
        ids = torch.stack([torch.randperm(total, generator=generator)[: case.top_k] for _ in range(case.tokens)])
    if case.remote_experts:
        ids[-1] = case.experts + torch.arange(case.top_k) % case.remote_experts  # a token with no local expert
        ids = torch.where(ids >= case.experts, -1, ids)
    weights = torch.rand((case.tokens, case.top_k), generator=generator) + 0.1
    return ids.to(getattr(torch, case.ids)), weights / weights.sum(dim=1, keepdim=True)


def _row_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest per-row error relative to the row's scale; a row that must be zero must be exactly zero (NaN is
    never within tolerance)."""
    diff = (got.double() - want).abs().amax(dim=1)
    scale = want.abs().amax(dim=1)
    relative = torch.where(scale > 0, diff / scale.clamp_min(1e-300), torch.where(diff == 0, 0.0, float("inf")))
    return relative.max().item()


@contextlib.contextmanager
def _poisoned_empty() -> Iterator[None]:
    """torch.empty filled with NaN, so an output element the kernels forget to write shows up as an error."""
    original = torch.empty

    def empty(*args, **kwargs):
        tensor = original(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = original


def _run_case(case: Case, seed: int = 0) -> dict[str, object]:
    """One case through the kernels; needs TRITON_INTERPRET=1 set before triton was imported."""
    from pagerail.worker.layers.moe_activation import ExpertActivation
    from pagerail.worker.layers.triton_moe import _launch_config, fused_moe_available, triton_fused_experts

    generator = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    hidden = torch.randn((case.tokens, case.hidden + 8), generator=generator).to(dtype)
    hidden = hidden[:, : case.hidden] if case.strided_hidden else hidden[:, 8:].contiguous()
    # The clamped SwiGLU's gate and up spread over about ±16, so its clamps at ±7 bind on many entries.
    spread = 4.0 if case.activation == "swiglu_clamped" else 1.0
    w13 = torch.randn((case.experts, 2 * case.inter, case.hidden), generator=generator) * spread * case.hidden**-0.5
    w13 = w13.to(dtype)
    w2 = (torch.randn((case.experts, case.hidden, case.inter), generator=generator) * case.inter**-0.5).to(dtype)
    biases = (None, None)
    if case.bias:
        biases = tuple(torch.randn(shape, generator=generator).to(dtype) for shape in (w13.shape[:2], w2.shape[:2]))
    topk_ids, topk_weights = _routing(case, generator)
    assert fused_moe_available(hidden, w13, w2), "the interpreter must be on for CPU tensors"
    with _poisoned_empty():
        got = triton_fused_experts(hidden, w13, w2, topk_weights, topk_ids, *biases, ExpertActivation(case.activation))
    assert got.dtype == dtype and got.shape == hidden.shape
    want = fused_experts_reference(hidden, w13, w2, topk_weights, topk_ids, *biases, case.activation)
    counts = torch.bincount(topk_ids[topk_ids >= 0].long(), minlength=case.experts)
    remote_rows = (topk_ids < 0).all(dim=1)
    return {
        "error": _row_error(got, want),
        "remote_rows_max": got[remote_rows].abs().max().item() if remote_rows.any() else 0.0,
        "block_m": _launch_config(topk_ids.numel(), case.experts, dtype)["BLOCK_M"],
        "expert_counts": counts.tolist(),
        "remote_slots": int((topk_ids < 0).sum()),
    }


def _report() -> None:
    """Entry point of the interpreter subprocess: one JSON line of {case name: results}."""
    print(json.dumps({case.name: _run_case(case) for case in CASES}))


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    return interpreted_report("tests.test_triton_moe")


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_kernel_matches_reference(case: Case, interpreted: dict[str, dict]) -> None:
    result = interpreted[case.name]
    assert result["error"] <= TOLERANCE[case.dtype], f"{asdict(case)}: relative row error {result['error']:.3g}"
    # A token whose every expert is on another rank gets exactly zero.
    assert result["remote_rows_max"] == 0.0


def test_cases_cover_the_routing_shapes(interpreted: dict[str, dict]) -> None:
    counts = [count for result in interpreted.values() for count in result["expert_counts"]]
    block_ms = {result["block_m"] for result in interpreted.values()}
    assert 0 in counts and 1 in counts, "experts with 0 and 1 tokens"
    assert any(max(r["expert_counts"]) > r["block_m"] for r in interpreted.values()), "an expert over several blocks"
    assert block_ms == {16, 32, 64}
    assert all(interpreted[c.name]["remote_slots"] > 0 for c in CASES if c.remote_experts)
    assert {c.top_k for c in CASES} >= {1, 2, 8} and {c.dtype for c in CASES} == set(TOLERANCE)


ALIGN_CASES = [(1, 8, 1, 16), (24, 8, 2, 16), (40, 128, 8, 16), (33, 16, 2, 32), (96, 8, 8, 64), (5, 4, 4, 16)]


@pytest.mark.parametrize(("tokens", "experts", "top_k", "block_m"), ALIGN_CASES)
@pytest.mark.parametrize("remote", [False, True])
def test_align_gives_each_block_one_expert_and_empty_experts_none(
    tokens: int, experts: int, top_k: int, block_m: int, remote: bool
) -> None:
    from pagerail.worker.layers.triton_moe import NON_LOCAL_BLOCK, UNUSED_BLOCK, moe_align

    generator = torch.Generator().manual_seed(tokens * experts + top_k)
    total = 2 * experts if remote else experts
    ids = torch.stack([torch.randperm(total, generator=generator)[:top_k] for _ in range(tokens)])
    ids = torch.where(ids >= experts, -1, ids)
    sorted_slots, block_experts = moe_align(ids, experts, block_m)
    assert sorted_slots.dtype == block_experts.dtype == torch.int32
    blocks = sorted_slots.view(-1, block_m).long()
    flat = ids.reshape(-1)

    real = sorted_slots[sorted_slots >= 0].long()
    assert sorted(real.tolist()) == list(range(ids.numel())), "every slot exactly once"
    used = block_experts != UNUSED_BLOCK
    assert used.sum() >= 1 and not used[int(used.sum()) :].any(), "unused blocks only at the end"
    assert (blocks[~used] == -1).all()
    for block, expert in zip(blocks[used], block_experts[used].tolist(), strict=True):
        slots = block[block >= 0]
        assert slots.numel() > 0, "no block without a slot"
        assert (flat[slots] == (-1 if expert == NON_LOCAL_BLOCK else expert)).all()
        assert torch.equal(slots, slots.sort().values), "an expert's slots in token order"
    counts = torch.bincount(flat[flat >= 0], minlength=experts)
    blocks_per_expert = torch.bincount(block_experts[block_experts >= 0].long(), minlength=experts)
    assert torch.equal(blocks_per_expert, (counts + block_m - 1) // block_m), "zero-token experts get no block"


def test_shapes_are_checked() -> None:
    from pagerail.worker.layers.triton_moe import triton_fused_experts

    hidden, w13, w2 = torch.zeros(3, 8), torch.zeros(4, 12, 8), torch.zeros(4, 8, 6)
    ids, weights = torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)
    with pytest.raises(ValueError, match="w2"):
        triton_fused_experts(hidden, w13, w2[:, :, :5], weights, ids)
    with pytest.raises(ValueError, match="w13"):
        triton_fused_experts(hidden, w13[:, :, :7], w2, weights, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        triton_fused_experts(hidden, w13, w2, weights[:2], ids)
    with pytest.raises(ValueError, match="dtype"):
        triton_fused_experts(hidden.half(), w13, w2, weights, ids)
    with pytest.raises(ValueError, match="give both or neither"):
        triton_fused_experts(hidden, w13, w2, weights, ids, torch.zeros(4, 12))
    with pytest.raises(ValueError, match=r"w13_bias / w2_bias \(4, 12\) / \(4, 7\) are not \[E, 2\*I\] / \[E, H\]"):
        triton_fused_experts(hidden, w13, w2, weights, ids, torch.zeros(4, 12), torch.zeros(4, 7))


# (name, experts, hidden, intermediate, top_k, dtypes): the MoE layers of Qwen3-30B-A3B, Mixtral-8x7B and
# DeepSeek-V2-Lite, and sizes that are not multiples of 16 (other specialisations of the size arguments).
HOPPER_SHAPES = [
    ("qwen3-30b-a3b", 128, 2048, 768, 8, ("bfloat16", "float16", "float32")),
    ("mixtral-8x7b", 8, 4096, 14336, 2, ("bfloat16",)),
    ("deepseek-v2-lite", 64, 2048, 1408, 6, ("bfloat16",)),
    ("odd", 8, 72, 40, 2, ("bfloat16",)),
    ("gpt-oss-20b", 32, 2880, 2880, 4, ("bfloat16",)),  # biases and the clamped SwiGLU
]


def _hopper_report() -> None:
    """Entry point of the child process: each distinct launch of the two kernels built for sm_90, as JSON."""
    import triton

    from pagerail.worker.layers import triton_moe
    from pagerail.worker.layers.moe_activation import SILU, ExpertActivation
    from tests.triton_launches import LaunchRecorder

    builds, failures, built = [], [], set()
    for shape, experts, hidden, inter, top_k, dtypes in HOPPER_SHAPES:
        recorder = LaunchRecorder(forward=False)
        with recording_kernels(recorder, triton_moe, "_gate_up_kernel", "_down_kernel"):
            for dtype in (getattr(torch, name) for name in dtypes):
                # One expert's weights viewed E times: the launch keys are those of real [E, ...] weights (a
                # zero stride specialises as any multiple of 16 does), without gigabytes of CPU memory.
                w13 = torch.empty((1, 2 * inter, hidden), dtype=dtype).expand(experts, -1, -1)
                w2 = torch.empty((1, hidden, inter), dtype=dtype).expand(experts, -1, -1)
                extras = (None, None, SILU)
                if shape.startswith("gpt-oss"):
                    biases = (
                        torch.empty((experts, 2 * inter), dtype=dtype),
                        torch.empty((experts, hidden), dtype=dtype),
                    )
                    extras = (*biases, ExpertActivation("swiglu_clamped"))
                # Token counts that pick each row-block size: decode, prefills of 32 and 128 slots per expert.
                for tokens in (1, -(-32 * experts // top_k), -(-128 * experts // top_k)):
                    ids = torch.arange(tokens * top_k).view(tokens, top_k) % experts
                    x = torch.empty((tokens, hidden), dtype=dtype)
                    triton_moe.triton_fused_experts(x, w13, w2, torch.ones(tokens, top_k), ids, *extras)
        build_launches(recorder, built, builds, failures, shape=shape)
    print(json.dumps({"triton": triton.__version__, "builds": builds, "failures": failures}))


@pytest.fixture(scope="module")
def hopper_reports() -> dict[str, dict]:
    """The builds with this Triton and with the GPU image's, by two child processes at once (one core each)."""
    return hopper_reports_of("tests.test_triton_moe")


@pytest.mark.parametrize("which", ["this", "image"])
def test_kernels_build_for_sm90(which: str, hopper_reports: dict[str, dict]) -> None:
    """Every launch variant compiles for H100/H200 (offline, no GPU), fits shared memory, and does not spill at
    model sizes."""
    report = checked_report(which, hopper_reports, {"_gate_up_kernel", "_down_kernel"})
    assert {build["constexprs"]["BLOCK_M"] for build in report["builds"]} == {"16", "32", "64"}
    for build in report["builds"]:
        where = f"{build['kernel']} for {build['shape']} {build['constexprs']}"
        # Sizes that are not multiples of 16 defeat the asynchronous copies and spill; no model has them.
        if build["shape"] == "odd":
            continue
        if build["constexprs"]["DOT_DTYPE"] == "fp32":
            # fp32 is the parity mode (IEEE dots on CUDA cores), not a serving dtype: ptxas 13 (Triton 3.9, with the
            # --regAllocOptLevel=2 Triton passes) spills a few bytes at the 64-row gate/up block. Held to a bound.
            assert build["spill_stores"] + build["spill_loads"] <= 64, f"{where}: spills, {build['registers']} regs"
            continue
        assert build["spill_stores"] == build["spill_loads"] == 0, f"{where}: spills, {build['registers']} regs"
