"""The Tinker training API (docs/tinker.md): the HTTP protocol of the official ``tinker`` SDK,
served so that the unmodified SDK trains and samples against grpo-service. ``proto`` declares its
protobuf schema, ``wire`` reads and writes the protobuf bodies (forward_backward in, its output
and sample results out), ``schemas`` (with ``schema_parts``) the JSON bodies, and ``names`` the
ids and ``tinker://`` paths the SDK relies on. The rest:

- ``routes``: the SDK's paths (``/api/v1/...``), thin over the rules below;
- ``sampling_routes``: the sampling calls (sampling sessions and ``asample``);
- ``listing_routes``: ``GET /v1/tinker/sessions``, a project's sessions for the dashboard;
- ``listing_schemas``: its response bodies;
- ``presenters``: a page of a project's sessions as that route shows it;
- ``deps``: the SDK's caller (``X-API-Key: tml-<key>``) and the bounded bodies of its calls;
- ``service``: the rules of sessions, training models and their calls;
- ``samplers``: the rules of sampling sessions and their sample calls;
- ``admission``: what a call may not ask of its model or of this server, checked before storing;
- ``catalog``: what the API tells about models and saves (capabilities, info, weights info);
- ``futures``: ``retrieve_future``: a call's result, waited for while it is queued;
- ``dispatch``: sending a training model to a worker on the Tinker queue;
- ``storage``: the bytes stored calls hold in the database, and their bound;
- ``repository``: the queries of the Tinker API, each scoped by project;
- ``worker_repository``: the queries of the worker that holds a training model;
- ``upkeep_repository``: the queries of the Tinker API's upkeep in the workers' maintenance.
"""
