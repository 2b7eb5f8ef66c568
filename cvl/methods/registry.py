"""Method registry: `@register("name")` on a Method subclass makes it a `--method` choice."""

from __future__ import annotations

import importlib

from cvl.errors import CvlError

_REGISTRY: dict[str, type] = {}

# Modules that register methods; `cvl methods` and `--method` see all of them.
METHOD_MODULES = [
    "cvl.methods.seqft",
    "cvl.methods.joint",
    "cvl.methods.zeroshot",
    "cvl.methods.ctp",
    "cvl.methods.modx",
    "cvl.methods.dkr",
    "cvl.methods.dha",
    "cvl.methods.incclip",
    "cvl.methods.ewc",
    "cvl.methods.si",
    "cvl.methods.mas",
    "cvl.methods.rwalk",
    "cvl.methods.afec",
    "cvl.methods.lwf",
    "cvl.methods.icarl",
    "cvl.methods.lucir",
    "cvl.methods.der",
    "cvl.methods.co2l",
    "cvl.methods.geodl",
    "cvl.methods.erl",
    "cvl.methods.afc",
    "cvl.methods.wise",
    "cvl.methods.zscl",
    "cvl.methods.ema_merge",
    "cvl.methods.ema_step",
    "cvl.methods.zs_merge",
    "cvl.methods.ft_merge",
    "cvl.methods.task_arith",
    "cvl.methods.ties",
    "cvl.methods.model_stock",
    "cvl.methods.magmax",
    "cvl.methods.dare",
    "cvl.methods.breadcrumbs",
    "cvl.methods.slerp",
    "cvl.methods.tall_masks",
    "cvl.methods.opcm",
    "cvl.methods.cclip",
    "cvl.methods.lora_per_task",
    "cvl.methods.moe_adapters",
]


def register(name: str):
    """Class decorator registering a Method under its CLI name."""

    def deco(cls: type) -> type:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise RuntimeError(f"method '{name}' registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def _load_all() -> None:
    for mod in METHOD_MODULES:
        importlib.import_module(mod)


def all_methods() -> dict[str, type]:
    """Every registered method, by name (sorted)."""
    _load_all()
    return dict(sorted(_REGISTRY.items()))


def get_method(name: str) -> type:
    """The Method class for a CLI name, or a CvlError listing the choices."""
    methods = all_methods()
    if name not in methods:
        raise CvlError(f"unknown method '{name}' (available: {', '.join(methods)})")
    return methods[name]
