import pytest
import torch
from torch import nn

from moebus.engine.cpu_linear import PACKED_MAX_ROWS, PackedLinear, pack_linears, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="torch built without oneDNN")


def test_packed_linear_matches_plain_linear_for_every_row_count():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 160, bias=False), nn.Linear(160, 40, bias=True)).bfloat16()
    plain = [m.weight.clone() for m in model]
    x = torch.randn(PACKED_MAX_ROWS + 5, 96, dtype=torch.bfloat16)
    expected = model(x)
    assert pack_linears(model) == 2 and all(type(m) is PackedLinear for m in model)
    assert all(torch.equal(m.weight, w) for m, w in zip(model, plain, strict=True))  # shared, untouched
    for rows in (1, 7, 64, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 5):  # packed and plain paths
        torch.testing.assert_close(model(x[:rows]), expected[:rows], rtol=1.6e-2, atol=1e-2)
    assert model(x[:3].view(1, 3, 96)).shape == (1, 3, 40)


def test_only_bf16_linears_are_packed():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).bfloat16())
    assert pack_linears(model) == 1
    assert type(model[0]) is nn.Linear and type(model[1]) is PackedLinear
