"""fp8 → fp32 on CPUs by bit arithmetic: torch's own conversion there runs element by element, several times slower
than the matmul it feeds."""

from __future__ import annotations

import threading

import torch

# e4m3's exponent bias is 7, fp32's 127: its bits placed in fp32's fields read 2^-120 of the value (subnormals
# included, as fp32 subnormals), and a power-of-two product restores it exactly.
_E4M3_TO_FP32 = 2.0**120
# The sign bit and the 7 exponent-and-mantissa bits, once shifted into fp32's top bits (a tensor: and-ing with a
# Python int takes a slower path).
_E4M3_MASK = torch.tensor(0x07F00000 | -0x80000000, dtype=torch.int32)
_scratch = threading.local()


def fp8_to_float32(values: torch.Tensor, reuse_buffer: bool = False) -> torch.Tensor:
    """An fp8 tensor (e4m3fn or e5m2) as fp32, exactly (e4m3fn's NaN code aside).

    `reuse_buffer`: write into this thread's scratch buffer of that size instead of fresh memory (whose page
    faults cost as much as the conversion); the result is then valid only until the next such call.
    """
    if values.device.type != "cpu":
        return values.to(torch.float32)
    if values.dtype == torch.float8_e5m2:
        # e5m2 is the top byte of an fp16.
        return (values.view(torch.uint8).to(torch.int16) << 8).view(torch.float16).to(torch.float32)
    if values.dtype != torch.float8_e4m3fn:
        raise ValueError(f"expects float8_e4m3fn or float8_e5m2, got {values.dtype}")
    bits = _buffer(values.shape) if reuse_buffer else torch.empty(values.shape, dtype=torch.int32)
    # int8 sign-extends, so one shift puts the sign in bit 31 and the rest in bits 20..26.
    bits.copy_(values.view(torch.int8))
    torch.bitwise_left_shift(bits, 20, out=bits)
    bits.bitwise_and_(_E4M3_MASK)
    return bits.view(torch.float32).mul_(_E4M3_TO_FP32)


def _buffer(shape: torch.Size) -> torch.Tensor:
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = {}
    numel = shape.numel()
    if numel not in buffers:
        buffers[numel] = torch.empty(numel, dtype=torch.int32)
    return buffers[numel].view(shape)
