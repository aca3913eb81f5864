"""The Tinker training API (issue 37): the HTTP protocol of the official ``tinker`` SDK, served
so that the unmodified SDK trains and samples against grpo-service. ``proto`` declares its
protobuf schema, ``wire`` reads and writes the protobuf bodies (forward_backward in, its output
and sample results out), ``schemas`` (with ``schema_parts``) the JSON bodies, and ``names`` the
ids and ``tinker://`` paths the SDK relies on."""
