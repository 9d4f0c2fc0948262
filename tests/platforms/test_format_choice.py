"""weight_format auto (platforms/format_choice.py): the GGUF's blocks only where they were measured the
faster lone stream and as faithful; dense weights everywhere else, each with its reason."""
from pathlib import Path

import pytest

from moebus.engine.config import EngineConfig
from moebus.engine.models import resolve
from moebus.platforms.format_choice import choose_format

ZEN4 = {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"}


def test_a_llama_gguf_on_avx512_takes_its_blocks_in_float32():
    c = choose_format(resolve("smollm2"), "auto", "auto", flags=ZEN4)
    assert (c.weight_format, c.dtype) == ("gguf", "float32"), c


@pytest.mark.parametrize("flags,dtype,device,why", [
    ({"avx2", "fma"}, "auto", "cpu", "no AVX-512"),
    (ZEN4 | {"amx_bf16", "amx_tile"}, "auto", "cpu", "AMX"),
    (ZEN4, "bfloat16", "cpu", "dtype bfloat16 asked for"),
    (ZEN4, "auto", "cuda", "device cuda"),
])
def test_dense_elsewhere(flags, dtype, device, why):
    c = choose_format(resolve("smollm2"), "auto", dtype, device, flags=flags)
    assert c.weight_format == "dense" and c.dtype == dtype and why in c.reason, c


def test_a_checkpoint_directory_is_dense(tmp_path: Path):
    c = choose_format(tmp_path, "auto", "auto", flags=ZEN4)
    assert c.weight_format == "dense" and "not a GGUF" in c.reason


def test_facts_read_from_the_header_decide_without_the_file():
    """services/worker_memory.py passes what the GGUF's header says: nothing is read or converted."""
    missing = Path("/nonexistent/model.gguf")
    c = choose_format(missing, "auto", "auto", flags=ZEN4, gguf_facts=("LlamaForCausalLM", 0.99))
    assert (c.weight_format, c.dtype) == ("gguf", "float32")
    c = choose_format(missing, "auto", "auto", flags=ZEN4, gguf_facts=("GraniteMoeForCausalLM", 1.0))
    assert c.weight_format == "dense" and "latency choice" in c.reason
    assert "0% of" in choose_format(missing, "auto", "auto", flags=ZEN4, gguf_facts=("LlamaForCausalLM", 0.0)).reason


def test_explicit_formats_pass_and_unknown_ones_fail():
    assert choose_format(resolve("smollm2"), "dense", "auto", flags=ZEN4).weight_format == "dense"
    assert choose_format(resolve("smollm2"), "gguf", "float32", flags=set()).weight_format == "gguf"
    with pytest.raises(ValueError, match="weight_format"):
        choose_format(resolve("smollm2"), "q4", "auto")


def test_the_engine_config_resolves_auto_before_its_dtype():
    cfg = EngineConfig(weight_format="auto", dtype="auto")
    assert cfg.weight_format in ("dense", "gguf") and cfg.dtype in ("float32", "bfloat16")
    if cfg.weight_format == "gguf":
        assert cfg.dtype == "float32"
    assert EngineConfig(weight_format="auto", dtype="bfloat16").weight_format == "dense"


def test_the_start_up_line_says_what_the_workers_will_run():
    from moebus.services.startup import summarize_model

    engine = {"dtype": "auto", "weight_format": "auto"}
    s, cfg = summarize_model("smollm2", engine), EngineConfig(**engine)
    assert (s.weight_format, s.dtype) == (cfg.weight_format, cfg.dtype)
    assert ("GGUF's quantized blocks" in str(s)) == (cfg.weight_format == "gguf")
    dense = summarize_model("smollm2", {"dtype": "float32", "weight_format": "auto"})
    assert (dense.weight_format, dense.dtype) == ("dense", "float32") and str(dense).endswith("float32")


def test_q4_k_weights_do_not_count_for_auto(tmp_path: Path):
    """auto weighs only the types the kernels take as they are: a Q4_K file's blocks (rewritten at
    load, loader/kquants.py) are served when asked for, not chosen by auto (not measured there)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    from moebus.loadtest.kquant_file import quantize_q4_k
    from moebus.platforms.format_choice import _quantized_share

    def write(name: str, qtype: GGMLQuantizationType) -> Path:
        w = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32)
        blocks = quantize_q4_k(w) if qtype == GGMLQuantizationType.Q4_K else quantize(w, qtype)
        writer = GGUFWriter(str(tmp_path / name), "llama")
        writer.add_tensor("blk.0.attn_q.weight", blocks, raw_shape=blocks.shape, raw_dtype=qtype)
        writer.add_tensor("output_norm.weight", np.ones(256, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return tmp_path / name

    assert _quantized_share(write("q4_k.gguf", GGMLQuantizationType.Q4_K)) == 0.0
    assert _quantized_share(write("q8_0.gguf", GGMLQuantizationType.Q8_0)) == pytest.approx(2048 / 2304)
