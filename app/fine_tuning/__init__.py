"""OpenAI's fine-tuning API (/v1/fine_tuning) over native jobs: its bodies, the translation of
its requests into job specs, its views of jobs, events (the timeline) and checkpoints."""
