"""``specc::small_m_linear`` (kernels/small_m_gemv.py, kernels/small_m_gemv.cpp).

* the op equals its reference (fp32 math on the bf16 inputs, one rounding) within bf16
  rounding, for 1-16 rows, odd N and K (AMX blocks, AVX512 tails and masked K tails),
  with and without bias, 1-/2-/3-D inputs, and more than 16 rows (the reference path);
* it traces through ``torch.export`` (fake kernel) and stays one call in the graph.

The kernel tests are skipped on CPUs without AVX512_BF16 or where the C++ build fails
(no compiler): there every call is the reference, which these tests compare against.
The first run builds the kernel (~1 min; cached under ~/.cache/specc/torch_extensions).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specc.kernels.small_m_gemv import (MAX_ROWS, MAX_ROWS_F32, kernel_available, small_m_linear,
                                        small_m_linear_reference)

needs_kernel = pytest.mark.skipif(not kernel_available(), reason="no AVX512_BF16 or no C++ toolchain")


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.dtype == ref.dtype and y.shape == ref.shape
    # summation order differs (fp32 partial sums): allow a couple of bf16 steps of the output
    tol = 2 * 2 ** -8 * ref.float().abs().clamp_min(1.0)
    assert ((y.float() - ref.float()).abs() <= tol).all(), (y.float() - ref.float()).abs().max()


@needs_kernel
@pytest.mark.parametrize("rows", list(range(1, MAX_ROWS + 1)))
def test_matches_reference_all_rows(rows):
    g = torch.Generator().manual_seed(rows)
    for n, k, bias in [(37, 33, True), (96, 64, False), (131, 576, True), (64, 1, False), (17, 577, True)]:
        x = torch.randn(rows, k, generator=g).bfloat16()
        w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
        b = torch.randn(n, generator=g).bfloat16() if bias else None
        _close(small_m_linear(x, w, b), small_m_linear_reference(x, w, b))


@needs_kernel
@pytest.mark.parametrize("shape", [(576,), (3, 576), (1, 5, 576), (2, 3, 96), (4, 4, 33), (5, 7, 64)])
def test_matches_reference_input_ranks(shape):
    """1-D and batched inputs; (5, 7, 64) has 35 rows, past MAX_ROWS: the reference path."""
    g = torch.Generator().manual_seed(len(shape))
    k = shape[-1]
    x = torch.randn(*shape, generator=g).bfloat16()
    w = (torch.randn(160, k, generator=g) / k ** 0.5).bfloat16()
    b = torch.randn(160, generator=g).bfloat16()
    for bias in (None, b):
        y = small_m_linear(x, w, bias)
        assert y.shape == (*shape[:-1], 160)
        _close(y, small_m_linear_reference(x, w, bias))


@needs_kernel
@pytest.mark.parametrize("rows", [*range(1, MAX_ROWS + 1), 20, 33, MAX_ROWS_F32, MAX_ROWS_F32 + 1])
def test_fp32_matches_reference_all_rows(rows):
    """The fp32 path (AVX-512 FMAs, row groups of <= 6, 8/4/1 weight rows a block, masked
    K tails) against a float64 reference: fp32 summation error only (41 rows: the
    reference path)."""
    g = torch.Generator().manual_seed(100 + rows)
    for n, k, bias in [(37, 33, True), (96, 64, False), (131, 576, True), (64, 1, False), (17, 577, True),
                       (9, 1536, False)]:
        x = torch.randn(rows, k, generator=g)
        w = torch.randn(n, k, generator=g) / k ** 0.5
        b = torch.randn(n, generator=g) if bias else None
        y = small_m_linear(x, w, b)
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        assert y.dtype == torch.float32 and y.shape == want.shape
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_fp32_row_independent_of_row_count():
    """A row's result is bitwise the same whatever the other rows are (decode = 1 row,
    verify = k+1 rows): greedy speculative output then equals greedy decode exactly."""
    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(203, 577, generator=g), torch.randn(203, generator=g)
    x = torch.randn(MAX_ROWS_F32, 577, generator=g)
    alone = small_m_linear(x[:1], w, b)
    for rows in range(1, MAX_ROWS_F32 + 1):
        assert torch.equal(small_m_linear(x[:rows], w, b)[:1], alone), rows


@needs_kernel
def test_strided_inputs_and_other_dtypes():
    x = torch.randn(6, 128).bfloat16()[:, ::2]  # [6, 64], not contiguous
    w = torch.randn(64, 48).bfloat16().t()  # [64 out... transposed view [48, 64]]
    _close(small_m_linear(x, w), small_m_linear_reference(x, w))
    x32, w32 = torch.randn(3, 128)[:, ::2], torch.randn(40, 64).t().contiguous().t()[:24]
    torch.testing.assert_close(small_m_linear(x32, w32), x32 @ w32.t())
    x16, w16 = torch.randn(3, 40).half(), torch.randn(24, 40).half()  # no fast path: the reference
    torch.testing.assert_close(small_m_linear(x16, w16), small_m_linear_reference(x16, w16))


def test_reference_definition():
    x, w, b = torch.randn(2, 8).bfloat16(), torch.randn(4, 8).bfloat16(), torch.randn(4).bfloat16()
    want = (x.float() @ w.float().t() + b.float()).bfloat16()
    torch.testing.assert_close(small_m_linear_reference(x, w, b), want)


def test_exports_as_one_call():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(24, 16).bfloat16())

        def forward(self, x):
            return small_m_linear(x, self.w) * 2

    ep = torch.export.export(M(), (torch.randn(1, 5, 16).bfloat16(),))
    calls = [n for n in ep.graph.nodes if n.target is torch.ops.specc.small_m_linear.default]
    assert len(calls) == 1 and calls[0].meta["val"].shape == (1, 5, 24)


def test_bad_shapes_raise():
    with pytest.raises(RuntimeError):
        small_m_linear(torch.randn(2, 8).bfloat16(), torch.randn(4, 9).bfloat16())
