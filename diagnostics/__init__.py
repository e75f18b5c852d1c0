"""diagnostics: model-agnostic measurement of per-layer activation and gradient variance."""
