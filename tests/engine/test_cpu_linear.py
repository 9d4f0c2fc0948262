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


def test_tied_lm_head_gets_a_packed_head_sharing_the_embedding():
    from moebus.engine.models.llama import LlamaArgs, LlamaForCausalLM

    torch.manual_seed(0)
    args = LlamaArgs(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    model = LlamaForCausalLM(args).bfloat16()
    hidden = torch.randn(5, 64, dtype=torch.bfloat16)
    expected = model.compute_logits(hidden)
    assert model.lm_head is None
    pack_linears(model)
    assert type(model.lm_head) is PackedLinear and model.lm_head.weight is model.embed_tokens.weight
    assert "lm_head.weight" not in dict(model.named_parameters())  # shared, not a second parameter
    torch.testing.assert_close(model.compute_logits(hidden), expected, rtol=1.6e-2, atol=1e-2)
