"""Who is calling: projects and API keys (created, shown once, authenticated), the dashboard's
session cookie (/v1/session), and the principal every authenticated route depends on.

- ``deps``: the authenticated caller (an API key or the session cookie) and the cross-site guard;
- ``routes``: ``/v1/session``, the dashboard's sign-in and sign-out;
- ``keys_routes``: ``/v1/keys``, the project's API keys and their revocation;
- ``schemas``: the bodies of ``/v1/session``;
- ``service``: projects and API keys: creation, authentication, first-start bootstrap;
- ``repository``: the queries of projects and API keys;
- ``revocations``: a revoked key refused at once by every API process.
"""
