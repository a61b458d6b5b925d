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

    monkeypatch.setattr(layers, "_slow_bfloat16", lambda: True)
    monkeypatch.setattr(layers.F, "linear", spy)
    torch.manual_seed(0)
    w, b = torch.randn(48, 96).bfloat16(), torch.randn(48).bfloat16()
    for rows, widened in ((layers.UPCAST_ROWS - 1, torch.bfloat16), (layers.UPCAST_ROWS, torch.float32)):
        x = torch.randn(rows, 96).bfloat16()
        y = layers.linear(x, w, b)
        assert calls[-1] == widened and y.dtype == torch.bfloat16
        want = real(x.float(), w.float(), b.float())
        torch.testing.assert_close(y.float(), want, atol=0, rtol=2**-8)  # one bfloat16 rounding
