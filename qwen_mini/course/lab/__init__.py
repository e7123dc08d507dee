"""The chapters' experiments and exercise-only helpers (parameter counts, tiny training runs,
sweeps, conversions), one module per chapter. Nothing here is imported to run a model."""
