"""Architecture name -> model family: the one place that lists the supported architectures.

A family (``models/family.py``) declares its HF architecture names, the config.json
``model_type`` values and the GGUF ``general.architecture`` values it answers to;
``register_family`` adds all of them. ``ModelArchConfig`` accepts exactly the registered
architectures, and the decoder reads its family from here. Pure Python (no torch).

``register_family`` is also how a plug-in (or a test's toy family) adds one:
``register_family(MyFamily)`` before the model loads, ``unregister_family(MyFamily)`` after.
"""

from __future__ import annotations

from kvwise.models.family import LlamaFamily, ModelFamily
from kvwise.models.gemma import Gemma2Family, Gemma3Family
from kvwise.models.moe_families import (
    DeepseekFamily,
    GptOssFamily,
    MixtralFamily,
    QwenMoeFamily,
)

_FAMILIES: dict[str, type[ModelFamily]] = {}  # HF architecture name -> family
_HF_MODEL_TYPES: dict[str, str] = {}  # config.json model_type -> architecture
_GGUF_ARCHITECTURES: dict[str, str] = {}  # GGUF general.architecture -> architecture


def register_family(family: type[ModelFamily]) -> type[ModelFamily]:
    """Register ``family`` under its architectures, model types and GGUF names.

    Raises:
        ValueError: the declaration is inconsistent, or a name is taken by another family.
    """
    family.check()
    taken = [name for name in family.architectures if _FAMILIES.get(name, family) is not family]
    taken += [
        t
        for t in family.hf_model_types
        if _HF_MODEL_TYPES.get(t) not in (None, family.hf_model_types[t])
    ]
    taken += [
        g
        for g in family.gguf_architectures
        if _GGUF_ARCHITECTURES.get(g) not in (None, family.gguf_architectures[g])
    ]
    if taken:
        raise ValueError(f"family {family.__name__}: {', '.join(taken)} registered already")
    for name in family.architectures:
        _FAMILIES[name] = family
    _HF_MODEL_TYPES.update(family.hf_model_types)
    _GGUF_ARCHITECTURES.update(family.gguf_architectures)
    return family


def unregister_family(family: type[ModelFamily]) -> None:
    """Remove a family's names (tests that registered one). Names it does not hold are kept."""
    for name in [n for n, f in _FAMILIES.items() if f is family]:
        del _FAMILIES[name]
    for table in (_HF_MODEL_TYPES, _GGUF_ARCHITECTURES):
        for key in [k for k, arch in table.items() if arch not in _FAMILIES]:
            del table[key]


def supported_architectures() -> tuple[str, ...]:
    """The registered HF architecture names, in registration order."""
    return tuple(_FAMILIES)


def is_supported(architecture: str) -> bool:
    return architecture in _FAMILIES


def family_for(architecture: str) -> type[ModelFamily]:
    """The family that implements ``architecture``.

    Raises:
        ValueError: the architecture is not registered.
    """
    family = _FAMILIES.get(architecture)
    if family is None:
        raise unsupported(architecture)
    return family


def architecture_for_model_type(model_type: object) -> str | None:
    """The architecture a config.json ``model_type`` names; None: not registered."""
    return _HF_MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None


def architecture_for_gguf(gguf_architecture: str) -> str | None:
    """The architecture a GGUF ``general.architecture`` names; None: not registered."""
    return _GGUF_ARCHITECTURES.get(gguf_architecture)


def unsupported(name: str) -> ValueError:
    return ValueError(
        f"model: unsupported architecture '{name}'; supported: {', '.join(_FAMILIES)}"
    )


register_family(LlamaFamily)
register_family(Gemma2Family)
register_family(Gemma3Family)
register_family(QwenMoeFamily)
register_family(MixtralFamily)
register_family(GptOssFamily)
register_family(DeepseekFamily)
