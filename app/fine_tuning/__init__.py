"""OpenAI's fine-tuning API (/v1/fine_tuning) over native jobs: its bodies, the translation of
its requests into job specs, its views of jobs, events (the timeline) and checkpoints.

- ``routes``: the ``/v1/fine_tuning`` routes;
- ``schemas``: the OpenAI fine-tuning API's request and response bodies;
- ``service``: a fine-tuning request mapped to a native job spec;
- ``tools``: the part of that mapping for agent RFT: tools, environments and episodes;
- ``presenters``: jobs, events and checkpoints as the OpenAI API shows them;
- ``names``: the ``ft:`` names of a job's weights;
- ``timeline``: a job's events and step metrics as one newest-first list with cursors;
- ``timeline_repository``: the query that merges them.
"""
