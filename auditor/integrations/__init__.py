"""The auditor inside training code: ``audit_model`` on a live model (model.py, no framework imported), and
callbacks for training loops that import their framework only when used (transformers.py, lightning.py)."""
