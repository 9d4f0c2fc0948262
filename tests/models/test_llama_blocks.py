"""Llama building blocks on their own (the full model is checked against HF in tests/engine)."""
import torch

from moebus.engine.models.llama import LlamaArgs, LlamaMLP


def test_mlp_in_row_chunks_matches_one_pass():
    torch.manual_seed(0)
    args = LlamaArgs(vocab_size=32, hidden_size=48, intermediate_size=80, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=12)
    mlp = LlamaMLP(args.hidden_size, args.intermediate_size)
    x = torch.randn(11, 48)
    whole = mlp(x)
    mlp.chunk_rows = 4  # 11 rows: chunks of 4, 4, 3
    chunked = mlp(x)
    assert chunked.shape == whole.shape
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(whole, mlp.down_proj(torch.nn.functional.silu(mlp.gate_up_proj(x)[:, :80])
                                                    * mlp.gate_up_proj(x)[:, 80:]), rtol=1e-5, atol=1e-6)
