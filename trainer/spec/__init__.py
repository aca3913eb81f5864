"""The sections of the GRPO job spec, split by topic. Import them from :mod:`trainer.config`,
which re-exports every public name here; this package, like it, must stay torch-free."""
