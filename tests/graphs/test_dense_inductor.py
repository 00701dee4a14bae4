"""Inductor's generated code for a CP model: no standalone reorder or pack kernel around the collectives.

Forward: the all-gathered K/V buffer goes straight into the block executor (views only), and the send buffer
is written by a kernel that also does the model's own work (RoPE), so packing costs no extra pass.
Backward: the executor writes the gathered-K/V gradient in the layout the reduce-scatter sends.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import cpcompile
from cpcompile.testing.model import TinyConfig, TinyLlama
from tests.support.fake_pg import fake_group

KERNEL_CALL = re.compile(r"^\s*(cpp_fused_\w+|triton_\w+\.run|extern_kernels\.\w+)\((.*)\)", re.M)


def _kernel_calls(code: str) -> list[tuple[str, str]]:
    return KERNEL_CALL.findall(code)


def _names(code: str, buf: str) -> set[str]:
    """`buf` and every buffer Inductor declared as an alias (reinterpret_tensor view) of it."""
    aliases = re.findall(rf"^\s*(buf\d+) = reinterpret_tensor\({buf}\b.*# alias$", code, re.M)
    return {buf, *aliases}


def _uses(args: str, names: str | set[str]) -> bool:
    names = {names} if isinstance(names, str) else names
    return any(re.search(rf"\b{n}\b", args) for n in names)


@pytest.fixture(scope="module")
def generated_code():
    cfg = TinyConfig(layers=1)
    torch.manual_seed(0)
    model = TinyLlama(cfg)
    ids, pos = torch.randint(0, cfg.vocab, (1, 16)), torch.arange(16)[None]
    with fake_group(rank=1, world=4):
        compiled = torch.compile(model, backend=cpcompile.backend(strategy="zigzag"), fullgraph=True)

        def step():
            out = compiled(ids, pos)
            out.sum().backward()
            return out

        _, codes = run_and_get_code(step)
    assert len(codes) == 2, "expected one forward and one backward module"
    return codes


def test_gathered_kv_feeds_the_executor_without_copies(generated_code):
    fwd = generated_code[0]
    gathered = re.findall(r"(buf\d+) = torch\.ops\._c10d_functional\.all_gather_into_tensor", fwd)
    assert len(gathered) == 1, "one all-gather per attention layer"
    (buf,) = gathered
    readers = [name for name, args in _kernel_calls(fwd) if _uses(args, _names(fwd, buf))]
    assert readers == [], f"kernels copy the gathered K/V buffer {buf}: {readers}"
    kernel_calls = re.findall(r"_scaled_dot_product_flash_attention_for_cpu\.default\((.*)\)", fwd)
    # the local causal squares (one batched call), then the gathered blocks (three shapes)
    assert [_uses(call, _names(fwd, buf)) for call in kernel_calls] == [False, True, True, True], kernel_calls


def test_local_blocks_run_while_the_gather_is_in_flight(generated_code):
    """Inductor's schedule: issue the gather, run the local causal squares, wait, run the gathered blocks."""
    fwd = generated_code[0]
    kernel = "_scaled_dot_product_flash_attention_for_cpu.default"
    events = re.findall(rf"(all_gather_into_tensor\.default|wait_tensor\.default|{kernel})\(", fwd)
    assert events == ["all_gather_into_tensor.default", kernel, "wait_tensor.default", kernel, kernel, kernel], events


def test_send_buffer_is_written_by_a_fused_model_kernel(generated_code):
    fwd = generated_code[0]
    send = re.search(r"all_gather_into_tensor\.default\((?:reinterpret_tensor\()?(buf\d+)", fwd).group(1)
    writers = [name for name, args in _kernel_calls(fwd) if _uses(args, _names(fwd, send))]
    assert len(writers) == 1, writers
    assert "stack" in writers[0] and ("cos" in writers[0] or "mul" in writers[0]), (
        f"the K/V pack should be fused into the kernel computing K/V (RoPE), got {writers[0]}"
    )


def test_reduce_scatter_sends_the_executor_gradient_directly(generated_code):
    """The gathered K/V gradient is written once, by the kernel that sums the attention kernels' partial dK/dV
    (fp32) straight into the layout the reduce-scatter sends: no pack kernel after it, no other writer."""
    bwd = generated_code[1]
    sent = re.findall(r"reduce_scatter_tensor\.default\((?:reinterpret_tensor\()?(buf\d+)", bwd)
    assert len(sent) == 1, "one reduce-scatter per attention layer"
    (buf,) = sent
    writers = [(name, args) for name, args in _kernel_calls(bwd) if _uses(args, _names(bwd, buf))]
    assert len(writers) == 1, [w[0] for w in writers]
    grads = set(re.findall(r"(buf\d+) = torch\.ops\.aten\._scaled_dot_product_flash_attention_for_cpu_backward", bwd))
    outputs = {f"buf{int(b[3:]) + i}" for b in grads for i in (1, 2, 3)}  # each call's dq, dk, dv
    assert _uses(writers[0][1], outputs), f"{writers[0][0]} should sum the kernels' gradients"
