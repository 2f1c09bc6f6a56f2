"""Training side of Strata: config schema, model, data, the training loop and metrics."""
