"""Who is calling: projects and API keys (created, shown once, authenticated), the dashboard's
session cookie (/v1/session), and the principal every authenticated route depends on."""
