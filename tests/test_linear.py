"""``linear`` on CPUs without native bfloat16: many rows are multiplied widened to float32."""

import torch
import torch.nn.functional as F

from tiergen.models import layers


def test_many_bfloat16_rows_are_multiplied_in_float32_on_slow_cpus(monkeypatch):
    calls = []
    real = F.linear

    def spy(x, w, b=None):
        calls.append(x.dtype)
        return real(x, w, b)

    monkeypatch.setattr(layers, "cpu_has_fast_bfloat16", lambda: False)
    monkeypatch.setattr(layers.F, "linear", spy)
    torch.manual_seed(0)
    monkeypatch.setattr(layers, "UPCAST_SCRATCH", 96 * 10)  # 10 rows at a time: 5 slices
    w, b = torch.randn(48, 96).bfloat16(), torch.randn(48).bfloat16()
    for shape, widened in (((layers.UPCAST_ROWS - 1, 96), torch.bfloat16),
                           ((layers.UPCAST_ROWS, 96), torch.float32), ((3, 50, 96), torch.float32)):
        calls.clear()
        x = torch.randn(shape).bfloat16()
        y = layers.linear(x, w, b)
        assert set(calls) == {widened} and len(calls) == (5 if widened == torch.float32 else 1)
        assert y.dtype == torch.bfloat16 and y.shape == (*shape[:-1], 48)
        want = real(x.float(), w.float(), b.float())
        torch.testing.assert_close(y.float(), want, atol=1e-6, rtol=2**-8)  # one bf16 rounding
