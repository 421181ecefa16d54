"""Model shapes from Hugging Face ``config.json`` files, and presets of the same form.

A preset is a small config dict holding the fields the planner reads, copied from the model's
published ``config.json`` (``source`` names it). :func:`model_from_config` turns either into a
:class:`ModelShape`: vocabulary and hidden size, tied or not, layers, KV heads and head size
(hence the KV cache a token takes), dtype. Multimodal configs nest the language model under
``text_config``; its fields win over the top level's. Fields a released config leaves to its
``transformers`` class default (Gemma 3's sparse ``text_config``) come from
:data:`CLASS_DEFAULTS`, which a test checks against ``transformers``. Pure: ``json`` only.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "bf16": "bf16", "fp16": "fp16",
          "fp32": "fp32", "float8_e4m3fn": "fp8"}
DTYPE_SIZE = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
ALIASES = {"hidden_size": ("n_embd",), "num_hidden_layers": ("n_layer",), "num_attention_heads": ("n_head",)}
CLASS_DEFAULTS: dict[str, dict[str, object]] = {
    "gpt2": {"tie_word_embeddings": True},
    "llama": {"tie_word_embeddings": False},
    "mistral": {"tie_word_embeddings": False},
    "qwen2": {"tie_word_embeddings": False},
    "qwen3": {"tie_word_embeddings": False},
    "qwen3_moe": {"tie_word_embeddings": False},
    "deepseek_v3": {"tie_word_embeddings": False},
    "gpt_oss": {"tie_word_embeddings": False},
    "glm4_moe": {"tie_word_embeddings": False},
    "gemma3_text": {"vocab_size": 262208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "tie_word_embeddings": True},
}
"""Per ``model_type``: the ``transformers`` class defaults of the fields the planner reads that
released configs may omit (a test compares every entry with ``AutoConfig.for_model``)."""


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a model. ``kv_heads``/``head_dim``: K and V per layer, or with
    ``kv_latent`` > 0 a multi-head latent cache (DeepSeek MLA) of that many elements per layer,
    shared by all heads. ``kv_bytes`` overrides the computed per-rank KV bytes per token (a
    figure quoted without a config)."""

    name: str
    vocab_size: int
    hidden_size: int
    tied: bool
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bf16"
    kv_latent: int = 0
    kv_bytes: float | None = None
    source: str = ""

    @property
    def kv_bytes_per_token(self) -> float:
        """KV-cache bytes one token takes in the whole model, one copy of every layer's cache
        (layers with a sliding window, as in gpt-oss and Gemma 3, counted in full: the figure for
        contexts within the window, an upper bound beyond it)."""
        if self.kv_bytes is not None:
            return self.kv_bytes
        per_layer = self.kv_latent if self.kv_latent else 2 * self.kv_heads * self.head_dim
        return self.layers * per_layer * DTYPE_SIZE[self.dtype]

    def kv_bytes_per_rank(self, attention_tp: int) -> float:
        """KV bytes a token takes on each rank when attention is tensor-parallel over
        ``attention_tp`` ranks: KV heads are split (at least one per rank, replicated beyond
        that); a latent cache is held whole by every rank; a quoted figure is per rank already."""
        if self.kv_bytes is not None or self.kv_latent:
            return self.kv_bytes_per_token
        per_rank = max(1, math.ceil(self.kv_heads / attention_tp))
        return self.layers * 2 * per_rank * self.head_dim * DTYPE_SIZE[self.dtype]

    def describe_kv(self, attention_tp: int) -> str:
        """One line: the KV bytes per token, how they follow from the config, and per rank."""
        b = DTYPE_SIZE[self.dtype]
        if self.kv_bytes is not None:
            how = "as quoted for this model"
        elif self.kv_latent:
            how = f"{self.layers} layers x {self.kv_latent}-element latent x {b} B, every rank holds it whole"
        else:
            how = f"{self.layers} layers x 2 (K, V) x {self.kv_heads} KV heads x {self.head_dim} x {b} B"
        per_rank = self.kv_bytes_per_rank(attention_tp)
        return (f"KV cache {self.kv_bytes_per_token:,.0f} B/token ({how}); "
                f"{per_rank:,.0f} B/token per rank at attention TP {attention_tp}")


def _field(config: dict, text: dict, key: str, where: str) -> object:
    defaults = CLASS_DEFAULTS.get(str(text.get("model_type", config.get("model_type", ""))), {})
    for name in (key, *ALIASES.get(key, ())):
        for source in (text, config):
            if source.get(name) is not None:
                return source[name]
    if key in defaults:
        return defaults[key]
    raise ValueError(f"{where}: missing {key!r}")


def _positive_int(value: object, key: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def model_from_config(config: dict, name: str = "config", *, tied: bool | None = None,
                      source: str = "") -> ModelShape:
    """The :class:`ModelShape` of a Hugging Face config dict (``text_config`` read first);
    ``tied`` overrides ``tie_word_embeddings``. One-line ``ValueError`` naming the field when one
    is missing or malformed."""
    where = name
    if not isinstance(config, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(config).__name__}")
    text = {} if config.get("text_config") is None else config["text_config"]
    if not isinstance(text, dict):
        raise ValueError(f"{where}: text_config must be an object, got {type(text).__name__}")
    kv_bytes = config.get("kv_bytes_per_token")
    if kv_bytes is not None and (isinstance(kv_bytes, bool) or not isinstance(kv_bytes, (int, float))
                                 or not 0 < kv_bytes < math.inf):
        raise ValueError(f"{where}: kv_bytes_per_token must be a positive number, got {kv_bytes!r}")
    ints = {key: _positive_int(_field(config, text, key, where), key, where)
            for key in ("vocab_size", "hidden_size")}
    if kv_bytes is not None:  # a quoted figure: the attention's shape is not needed
        return ModelShape(name, ints["vocab_size"], ints["hidden_size"], _tied(config, text, tied, where),
                          0, 0, 0, _dtype(config, text, where), 0, float(kv_bytes), source)
    ints |= {key: _positive_int(_field(config, text, key, where), key, where)
             for key in ("num_hidden_layers", "num_attention_heads")}
    try:
        kv_heads = _field(config, text, "num_key_value_heads", where)
    except ValueError:
        kv_heads = ints["num_attention_heads"]
    kv_heads = _positive_int(kv_heads, "num_key_value_heads", where)
    try:
        head_dim = _field(config, text, "head_dim", where)
    except ValueError:
        head_dim = ints["hidden_size"] // ints["num_attention_heads"]
    head_dim = _positive_int(head_dim, "head_dim", where)
    latent = 0
    if (text.get("kv_lora_rank") or config.get("kv_lora_rank")) is not None:
        latent = sum(_positive_int(_field(config, text, k, where), k, where)
                     for k in ("kv_lora_rank", "qk_rope_head_dim"))
    return ModelShape(name, ints["vocab_size"], ints["hidden_size"], _tied(config, text, tied, where),
                      ints["num_hidden_layers"], kv_heads, head_dim, _dtype(config, text, where), latent,
                      None, source)


def _tied(config: dict, text: dict, tied: bool | None, where: str) -> bool:
    if tied is not None:
        return tied
    value = _field(config, text, "tie_word_embeddings", where)
    if not isinstance(value, bool):
        raise ValueError(f"{where}: tie_word_embeddings must be true or false, got {value!r}")
    return value


def _dtype(config: dict, text: dict, where: str) -> str:
    raw = text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or config.get("torch_dtype")
    raw = "float32" if raw is None else raw  # transformers' default when a config names none
    if not isinstance(raw, str) or raw not in DTYPES:
        raise ValueError(f"{where}: unknown dtype {raw!r}; known: {', '.join(sorted(DTYPES))}")
    return DTYPES[raw]


def load_config(path: str | Path, *, tied: bool | None = None) -> ModelShape:
    """The :class:`ModelShape` of a ``config.json`` file, or of the ``config.json`` in a folder;
    one-line ``ValueError`` when it is missing, unreadable, not JSON or lacks a field."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        text = p.read_text()
    except OSError as e:
        raise ValueError(f"cannot read {str(p)!r}: {e.strerror or e}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(p)!r} is not valid JSON: {e.msg} at line {e.lineno}") from None
    return model_from_config(config, str(p), tied=tied, source=str(p))


def _hf(repo: str) -> str:
    return f"https://huggingface.co/{repo}/blob/main/config.json"


def _config(model_type: str, vocab: int, hidden: int, layers: int, heads: int, kv: int,
            head_dim: int | None = None, tied: bool = False, **extra: object) -> dict:
    """The fields the planner reads, named as in a Hugging Face config."""
    config = {"model_type": model_type, "vocab_size": vocab, "hidden_size": hidden,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
              "tie_word_embeddings": tied, "torch_dtype": "bfloat16", **extra}
    return config if head_dim is None else config | {"head_dim": head_dim}


def _gemma3(hidden: int, layers: int, heads: int, kv: int, **extra: object) -> dict:
    """A Gemma 3 multimodal config: its sparse ``text_config`` leaves the rest to the class."""
    return {"model_type": "gemma3", "torch_dtype": "bfloat16",
            "text_config": {"model_type": "gemma3_text", "hidden_size": hidden, "num_hidden_layers": layers,
                            "num_attention_heads": heads, "num_key_value_heads": kv, **extra}}


PRESET_CONFIGS: dict[str, tuple[str, dict]] = {
    # name: (source of the values, the config fields the planner reads)
    "deepseek-v4.1-flash": ("the study's reference model (vocab 129280, hidden 5120, untied, 890 B of KV "
                            "per token and rank)",
                            {"vocab_size": 129280, "hidden_size": 5120, "tie_word_embeddings": False,
                             "torch_dtype": "bfloat16", "kv_bytes_per_token": 890}),
    "llama-3.1-8b": (_hf("meta-llama/Llama-3.1-8B"), _config("llama", 128256, 4096, 32, 32, 8)),
    "llama-3.1-70b": (_hf("meta-llama/Llama-3.1-70B"), _config("llama", 128256, 8192, 80, 64, 8)),
    "llama-3.1-405b": (_hf("meta-llama/Llama-3.1-405B"), _config("llama", 128256, 16384, 126, 128, 8)),
    "llama-3-8b": (_hf("meta-llama/Meta-Llama-3-8B"), _config("llama", 128256, 4096, 32, 32, 8)),
    "llama-2-7b": (_hf("meta-llama/Llama-2-7b-hf"),
                   _config("llama", 32000, 4096, 32, 32, 32, torch_dtype="float16")),
    "qwen3-8b": (_hf("Qwen/Qwen3-8B"), _config("qwen3", 151936, 4096, 36, 32, 8, 128)),
    "qwen3-32b": (_hf("Qwen/Qwen3-32B"), _config("qwen3", 151936, 5120, 64, 64, 8, 128)),
    "qwen3-30b-a3b": (_hf("Qwen/Qwen3-30B-A3B"), _config("qwen3_moe", 151936, 2048, 48, 32, 4, 128)),
    "qwen3-235b-a22b": (_hf("Qwen/Qwen3-235B-A22B"), _config("qwen3_moe", 151936, 4096, 94, 64, 4, 128)),
    "qwen2.5-7b": (_hf("Qwen/Qwen2.5-7B"), _config("qwen2", 152064, 3584, 28, 28, 4)),
    "qwen2.5-0.5b": (_hf("Qwen/Qwen2.5-0.5B"), _config("qwen2", 151936, 896, 24, 14, 2, tied=True)),
    "deepseek-v3": (_hf("deepseek-ai/DeepSeek-V3"), _config("deepseek_v3", 129280, 7168, 61, 128, 128,
                                                           kv_lora_rank=512, qk_rope_head_dim=64)),
    "gpt-oss-120b": (_hf("openai/gpt-oss-120b"), _config("gpt_oss", 201088, 2880, 36, 64, 8, 64)),
    "gpt-oss-20b": (_hf("openai/gpt-oss-20b"), _config("gpt_oss", 201088, 2880, 24, 64, 8, 64)),
    "gemma-3-27b": (_hf("google/gemma-3-27b-it"), _gemma3(5376, 62, 32, 16, head_dim=128)),
    "gemma-3-12b": (_hf("google/gemma-3-12b-it"), _gemma3(3840, 48, 16, 8)),
    "glm-4.5": (_hf("zai-org/GLM-4.5"), _config("glm4_moe", 151552, 5120, 92, 96, 8, 128)),
    "glm-4.5-air": (_hf("zai-org/GLM-4.5-Air"), _config("glm4_moe", 151552, 4096, 46, 96, 8, 128)),
    "gpt2": (_hf("openai-community/gpt2"),
             {"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12}),
}
PRESETS: dict[str, ModelShape] = {name: model_from_config(config, name, source=source)
                                  for name, (source, config) in PRESET_CONFIGS.items()}
DEFAULT_PRESET = "deepseek-v4.1-flash"


def preset(name: str) -> ModelShape:
    """The preset called ``name`` (case-insensitive; ``ValueError`` listing the known ones)."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
