"""Vocabulary and hidden sizes of well-known models (values from their published configs)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    name: str
    vocab_size: int
    hidden_size: int
    tied: bool


PRESETS: dict[str, ModelShape] = {m.name: m for m in (
    ModelShape("deepseek-v4.1-flash", 129280, 5120, tied=False),
    ModelShape("llama-3-8b", 128256, 4096, tied=False),
    ModelShape("llama-2-7b", 32000, 4096, tied=False),
    ModelShape("qwen2.5-7b", 152064, 3584, tied=False),
    ModelShape("qwen2.5-0.5b", 151936, 896, tied=True),
    ModelShape("gpt2", 50257, 768, tied=True),
)}
DEFAULT_PRESET = "deepseek-v4.1-flash"


def preset(name: str) -> ModelShape:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
