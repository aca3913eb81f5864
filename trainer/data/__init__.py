"""Where a run's prompts come from:

- :mod:`trainer.data.dataset`: the job's dataset rows (inline, an uploaded file, generated), the
  held-out split, the prompts tokenized for the run, and the seeded sampler that picks each
  step's prompts;
- :mod:`trainer.data.saved_datasets`: the rows of a Hugging Face dataset saved to disk, or of a
  Hub dataset in the workers' cache.
"""
