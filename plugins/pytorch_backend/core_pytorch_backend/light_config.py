"""A GGUF checkpoint's config and tokenizer read without transformers' per-architecture lookups.

Importing a config class (``LlamaConfig``, ``Qwen3Config``...) imports ``transformers.activations`` and,
through it, ``torch.distributed.tensor``; ``AutoTokenizer`` imports the index of every model transformers
has and looks the config up again. Together 1.3-2 s of a 5-7 s start of ``core serve`` on the default
model (alternated starts on a 2-core AMD EPYC, Zen 5). So the folder a GGUF file's metadata is converted
into (``loader.cached_gguf_folder``) also keeps ``core-config.json``, written the first time the folder is
loaded the slow way: every attribute of the config, defaults resolved (``to_dict()``), the class
attributes JSON keeps, and the tokenizer class AutoTokenizer chose for the folder (its choice depends only
on the folder's files and the config, both fixed). Later starts read the config into a ``LightConfig``, a
plain ``PreTrainedConfig`` that answers each of those attributes as the class does (the tests compare
every attribute, for each architecture the backend builds), and load the tokenizer with the kept class.
Only a config without sub-configs (a text model) is kept; a file missing, unreadable, naming a class that
does not import, or written under another transformers version means the slow way (and a new file).
Code that needs the config class itself (the GGUF name map's meta-device skeleton, when its own cache
misses) asks ``full_config``.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any

from transformers.configuration_utils import PreTrainedConfig

from core.registry import import_target

from .cache_files import write_text_atomically

LIGHT_CONFIG_FILE = "core-config.json"


class LightConfig(PreTrainedConfig):
    """A config with no architecture-specific class: ``read_light_config`` makes a subclass of this one per
    file, holding the model type and the class attributes it kept."""


def _transformers_version() -> str:
    return importlib.metadata.version("transformers")


def _class_attributes(config: PreTrainedConfig, values: dict[str, Any]) -> dict[str, Any]:
    """The values ``config``'s class sets where PreTrainedConfig sets none or others (Gemma 3's
    ``default_theta``, the parallelism plans), as far as JSON keeps them exactly."""
    kept = {}
    for name in dir(type(config)):
        if name.startswith("_") or name in values or name == "model_type":
            continue
        value = getattr(type(config), name)
        if callable(value) or isinstance(value, property) or getattr(PreTrainedConfig, name, object()) == value:
            continue
        try:
            if json.loads(json.dumps(value)) == value:
                kept[name] = value
        except (TypeError, ValueError):
            continue
    return kept


def write_light_config(config: PreTrainedConfig, folder: Path, tokenizer_class: type | None) -> bool:
    """Keep ``config``'s attributes and the folder's tokenizer class (None: it has no tokenizer) in
    ``folder`` for ``read_light_config``; False where the config has sub-configs or the folder cannot be
    written."""
    if getattr(config, "sub_configs", None):
        return False
    values = config.to_dict()
    kept = {"model_type": config.model_type, "transformers_version": _transformers_version(), "values": values,
            "class_attributes": _class_attributes(config, values),
            "tokenizer_class": None if tokenizer_class is None else
            f"{tokenizer_class.__module__}:{tokenizer_class.__qualname__}"}
    return write_text_atomically(Path(folder) / LIGHT_CONFIG_FILE, json.dumps(kept, indent=1, sort_keys=True))


def read_light_config(folder: Path) -> tuple[LightConfig, type | None] | None:
    """The config and tokenizer class (None: no tokenizer) ``write_light_config`` kept in ``folder``; None
    where there is nothing this transformers can use."""
    try:
        kept = json.loads((Path(folder) / LIGHT_CONFIG_FILE).read_text())
        if kept["transformers_version"] != _transformers_version():
            return None
        model_type, values, class_attributes = kept["model_type"], dict(kept["values"]), dict(kept["class_attributes"])
        tokenizer_class = None if kept["tokenizer_class"] is None else import_target(kept["tokenizer_class"])
    except (OSError, ValueError, TypeError, KeyError, ImportError, AttributeError):
        return None
    cls = type(LightConfig.__name__, (LightConfig,), {**class_attributes, "model_type": model_type,
                                                       "__module__": __name__})
    config = cls.from_dict(values)
    for name, value in values.items():  # from_dict drops a few (use_cache, output_attentions)
        if name not in config.__dict__:
            setattr(config, name, value)
    return config, tokenizer_class


def full_config(config: PreTrainedConfig) -> PreTrainedConfig:
    """``config`` as its architecture's transformers class (imported now), for code that needs the class."""
    if not isinstance(config, LightConfig):
        return config
    from transformers import AutoConfig

    values = {name: value for name, value in config.to_dict().items() if name != "model_type"}
    return AutoConfig.for_model(config.model_type, **values)
