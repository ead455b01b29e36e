"""``specc.passes.small_m_linear``: few-row linears become fused row reductions.

Small modules (bias / no bias, 1-, 2- and 3-D inputs, odd sizes, rows 1..16, a weight
read by two linears) against plain ``F.linear`` on random inputs; the row limit and
symbolic row counts leave linears alone; the tiny Llama and Qwen2-style VerifyPrograms after
``fuse_projections`` computes the same logits and KV writes, re-exports, and (one
Inductor compile) runs compiled with the same result.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specc.passes.fuse_projections import fuse_projections
from specc.passes.signature import export_flat
from specc.passes.small_m_linear import DEFAULT_MAX_ROWS, small_m_linears
from specc.runtime.programs import VerifyProgram
from test_pretranspose_weights import MAX_LEN, assert_outputs_close, clone_kv, tiny_model, verify_args

LINEAR = torch.ops.aten.linear.default


def n_linear(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is LINEAR)


class TwoLinears(nn.Module):
    def __init__(self, k: int, n: int, bias: bool):
        super().__init__()
        self.a = nn.Linear(k, n, bias=bias)
        self.b = nn.Linear(n, k, bias=not bias)

    def forward(self, x):
        h = F.linear(x, self.a.weight, self.a.bias)  # the same weight read twice
        return self.b(torch.relu(h) + F.linear(x, self.a.weight)), h


@pytest.mark.parametrize("shape", [(7,), (1, 37), (3, 37), (2, 4, 37), (16, 37), (5, 1, 37)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_linear_on_random_inputs(shape, bias):
    torch.manual_seed(sum(shape) + bias)
    k = shape[-1]
    mod = TwoLinears(k, 45, bias).eval()
    x = torch.randn(*shape)
    gm = export_flat(mod, (x,))
    rows = x.numel() // k
    n = small_m_linears(gm, max_rows=16)
    assert n == 3 and n_linear(gm) == 0
    with torch.no_grad():
        for got, want in zip(gm(x), mod(x)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert rows <= 16


def test_row_limit_and_default():
    mod = TwoLinears(24, 40, True).eval()
    gm = export_flat(mod, (torch.randn(3, 4, 24),))  # 12 rows
    assert small_m_linears(gm, max_rows=8) == 0 and n_linear(gm) == 3
    assert small_m_linears(gm, max_rows=12) == 3
    assert DEFAULT_MAX_ROWS == 8
    with pytest.raises(ValueError, match="max_rows"):
        small_m_linears(gm, max_rows=0)


def test_symbolic_rows_left_alone():
    mod = TwoLinears(24, 40, False).eval()
    x = torch.randn(1, 5, 24)
    gm = export_flat(mod, (x,), ({1: torch.export.Dim("t", min=2, max=64)},))
    assert small_m_linears(gm) == 0 and n_linear(gm) == 3


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("b,t", [(1, 1), (1, 5), (2, 3), (3, 5)])
def test_verify_program_same_logits_and_kv(kind, b, t):
    cfg, model = tiny_model(kind)
    ids, pos, kv = verify_args(cfg, b, t)
    gm = export_flat(VerifyProgram(model, MAX_LEN), (ids, pos, kv))
    L = cfg.num_hidden_layers
    assert fuse_projections(gm) == 2 * L
    kv_ref = clone_kv(kv)
    ref = gm(ids, pos, *kv_ref)
    assert small_m_linears(gm) == (4 * L + 1 if b * t <= DEFAULT_MAX_ROWS else 0)
    kv_new = clone_kv(kv)
    assert_outputs_close(gm(ids, pos, *kv_new), ref)
    assert_outputs_close(kv_new, kv_ref)
    torch.export.export(gm, (ids, pos, *clone_kv(kv)), strict=False)  # re-exports


def test_inductor_compiled_rows_match():
    torch.manual_seed(3)
    w = torch.randn(50, 33)
    bias = torch.randn(50)
    mod = nn.Linear(33, 50)
    with torch.no_grad():
        mod.weight.copy_(w)
        mod.bias.copy_(bias)
    x = torch.randn(5, 33)
    gm = export_flat(mod.eval(), (x,))
    assert small_m_linears(gm) == 1
    compiled = torch.compile(gm, dynamic=False)
    with torch.no_grad():
        got = compiled(x)
    got = got[0] if isinstance(got, (tuple, list)) else got
    torch.testing.assert_close(got, F.linear(x, w, bias), atol=1e-5, rtol=1e-5)
