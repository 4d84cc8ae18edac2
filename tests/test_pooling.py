"""core.pooling without torch: sentence-transformers configs, truncation, cosine."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from core.errors import InvalidRequestError, UnsupportedError
from core.pooling import (
    PoolingConfig,
    cosine,
    relevance,
    sentence_transformers_max_length,
    sentence_transformers_pooling,
    truncate,
)


def _st_folder(tmp_path: Path, mode: str, normalize: bool) -> Path:
    modules = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({mode: True}))
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))
    return tmp_path


@pytest.mark.parametrize(("mode", "method"), [("pooling_mode_mean_tokens", "mean"),
                                              ("pooling_mode_cls_token", "cls"), ("pooling_mode_lasttoken", "last")])
@pytest.mark.parametrize("normalize", [True, False])
def test_sentence_transformers_config(tmp_path: Path, mode: str, method: str, normalize: bool):
    folder = _st_folder(tmp_path, mode, normalize)
    assert sentence_transformers_pooling(folder) == PoolingConfig(method, normalize)  # type: ignore[arg-type]
    assert sentence_transformers_max_length(folder) == 128


def test_a_folder_without_modules_declares_nothing(tmp_path: Path):
    assert sentence_transformers_pooling(tmp_path) is None and sentence_transformers_max_length(tmp_path) is None


def test_truncation_renormalises_and_needs_a_matryoshka_model():
    matryoshka = PoolingConfig("last", normalize=True, truncatable=True)
    cut = truncate
    assert cut([0.6, 0.8, 0.0], None, PoolingConfig()) == [0.6, 0.8, 0.0]
    assert math.hypot(*truncate([0.5, 0.5, 0.5, 0.5], 2, matryoshka)) == pytest.approx(1.0)
    assert cut([3.0, 4.0, 1.0], 2, PoolingConfig("last", normalize=False, truncatable=True)) == [3.0, 4.0]
    for dims, config in ((2, PoolingConfig()), (5, matryoshka), (0, matryoshka)):
        with pytest.raises(InvalidRequestError) as info:
            cut([1.0, 0.0, 0.0], dims, config)
        assert info.value.param == "dimensions"


def test_cosine():
    assert cosine([1.0, 0.0], [0.0, 2.0]) == 0.0 and cosine([1.0, 1.0], [2.0, 2.0]) == pytest.approx(1.0)
    assert cosine([0.0, 0.0], [1.0, 0.0]) == 0.0


def test_relevance_is_the_sigmoid_of_one_logit():
    assert relevance([0.0]) == 0.5 and relevance([2.0]) == pytest.approx(1 / (1 + math.exp(-2.0)))
    with pytest.raises(InvalidRequestError) as info:
        relevance([0.1, 0.2])
    assert info.value.param == "model"


def test_dense_modules_are_projections_in_order_and_other_modules_are_refused(tmp_path: Path):
    """LaBSE and distiluse project their pooled vectors (Dense, before Normalize): the folders come back in
    the modules' order for the backend to load; a module the pooling path does not run is refused by name."""
    folder = _st_folder(tmp_path, "pooling_mode_cls_token", True)
    modules = json.loads((folder / "modules.json").read_text())
    modules[2:2] = [{"idx": 3, "path": "3_Dense", "type": "sentence_transformers.models.Dense"},
                    {"idx": 2, "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    assert sentence_transformers_pooling(folder) == PoolingConfig("cls", True, projections=("2_Dense", "3_Dense"))
    modules.append({"idx": 5, "path": "5_WordWeights", "type": "sentence_transformers.models.WordWeights"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UnsupportedError, match="WordWeights"):
        sentence_transformers_pooling(folder)
