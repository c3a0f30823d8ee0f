"""README's "## Models" section names every architecture the registry serves natively, and
names as native nothing the registry lacks. Both are read as they stand when the test runs,
so a family added to one and not the other fails here.

A class-like name (`...ForCausalLM`, `...LMHeadModel`, `...ForConditionalGeneration`) in the
section claims native support, except in the paragraph about the transformers backend (the
one that mentions `--model-impl`), which may name any class transformers ships."""

from __future__ import annotations

import re
from pathlib import Path

from serve.models.registry import supported_architectures

README = Path(__file__).resolve().parents[2] / "README.md"
CLASS_NAME = re.compile(
    r"\b[A-Z][A-Za-z0-9_]*(?:ForCausalLM|LMHeadModel|ForConditionalGeneration)\b"
)


def models_section() -> str:
    text = README.read_text()
    start = text.index("\n## Models\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def native_claims(section: str) -> set[str]:
    paragraphs = re.split(r"\n\s*\n", section)
    return {
        name
        for paragraph in paragraphs
        if "--model-impl" not in paragraph
        for name in CLASS_NAME.findall(paragraph)
    }


def test_every_native_architecture_is_in_readme():
    section = models_section()
    missing = [a for a in supported_architectures() if not re.search(rf"\b{a}\b", section)]
    assert not missing, f"README's ## Models section does not name {missing}"


def test_readme_names_as_native_only_what_the_registry_serves():
    unknown = sorted(native_claims(models_section()) - set(supported_architectures()))
    assert not unknown, (
        f"README's ## Models section names {unknown}, which serve/models/registry.py does "
        "not serve natively (the transformers backend's paragraph, the one that mentions "
        "--model-impl, may name others)"
    )


def test_the_checks_read_class_names_and_skip_the_backend_paragraph():
    section = (
        "## Models\n\n`LlamaForCausalLM` and GPT2LMHeadModel, natively.\n\n"
        "With --model-impl transformers, `Cohere2ForCausalLM` too."
    )
    assert native_claims(section) == {"LlamaForCausalLM", "GPT2LMHeadModel"}
