"""Real models for examples and tests, built locally on first use (see ``smollm2``)."""
