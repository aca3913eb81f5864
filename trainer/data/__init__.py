"""Where a run's prompts come from: the job's dataset rows (inline, a file, a saved or Hub
dataset), the held-out split, the prompts tokenized for the run, and the sampler that picks
each step's prompts (:mod:`trainer.data.dataset`, :mod:`trainer.data.saved_datasets`)."""
